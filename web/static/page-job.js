// One job: live status over SSE (resuming with Last-Event-ID), the loss
// chart, the log tail, the result, and cancel / cancel-with-save / resume.
import { del, getJson, getText, postJson } from './api.js';
import { lineChart, lossSeries } from './chart.js';
import { badge, errorBox, formatDuration, formatNumber, formatTime, h, progressBar, replace } from './dom.js';
import { jobDuration } from './page-jobs.js';
import { EventStream } from './sse.js';

const FINISHED = new Set(['succeeded', 'failed', 'cancelled', 'interrupted']);
const CHECKPOINTING = new Set(['finetune']); // kinds that can save on cancel and resume
const LOG_TAIL_BYTES = 32 * 1024;
// Progress fields shown as metrics, in this order, with their labels.
const METRICS = [
  ['step', 'Step'], ['total_steps', 'Total steps'], ['epoch', 'Epoch'], ['loss', 'Loss'], ['eval_loss', 'Eval loss'],
  ['learning_rate', 'Learning rate'], ['lr', 'Learning rate'], ['tokens_per_s', 'Tokens/s'],
  ['bytes_done', 'Downloaded'], ['bytes_total', 'Size'], ['rate', 'Rate'], ['elapsed_s', 'Elapsed'], ['eta_s', 'ETA'],
];
const STREAM_LABELS = { connecting: 'connecting…', live: 'live', reconnecting: 'reconnecting…', ended: 'finished', error: 'stream error' };

function metricText(key, value) {
  if (typeof value !== 'number') return String(value);
  if (key.endsWith('_s')) return formatDuration(value);
  if (key.startsWith('bytes')) return `${formatNumber(value / 1048576, 1)} MiB`;
  if (key.includes('loss')) return value.toFixed(4);
  if (key === 'learning_rate' || key === 'lr') return value.toExponential(2);
  return formatNumber(value, Number.isInteger(value) ? 0 : 2);
}

function throttle(fn, ms) {
  let timer = null;
  return () => {
    if (timer === null) timer = setTimeout(() => { timer = null; fn(); }, ms);
  };
}

export function mount(root, [jobId]) {
  const url = (suffix = '') => `api/jobs/${encodeURIComponent(jobId)}${suffix}`;
  const title = h('h1', { text: jobId });
  const statusHost = h('span');
  const streamState = h('span', { class: 'stream-state', role: 'status', text: STREAM_LABELS.connecting });
  const actions = h('div', { class: 'actions' });
  const actionError = h('div');
  const summary = h('section', { class: 'card', 'aria-label': 'Status' }, h('p', { class: 'muted', text: 'Loading…' }));
  const chartCard = h('section', { class: 'card', 'aria-label': 'Loss', hidden: true });
  const metricsCard = h('section', { class: 'card', 'aria-label': 'Metrics', hidden: true });
  const resultCard = h('section', { class: 'card', 'aria-label': 'Result', hidden: true });
  const paramsCard = h('section', { class: 'card', 'aria-label': 'Parameters' });
  const logPre = h('pre', { class: 'log', tabindex: 0, 'aria-label': 'Log tail', text: '' });
  const logCard = h('section', { class: 'card', 'aria-labelledby': 'log-title' }, h('h2', { id: 'log-title', text: 'Log' }), logPre);

  root.append(
    h('p', { class: 'crumbs' }, h('a', { href: '#/jobs', text: '← Jobs' })),
    h('div', { class: 'page-head job-head' }, title, statusHost, streamState, h('span', { class: 'spacer' }), actions),
    actionError,
    h('div', { class: 'job-grid' },
      h('div', { class: 'col' }, summary, chartCard, metricsCard, logCard),
      h('div', { class: 'col' }, resultCard, paramsCard)));

  let job = null;
  let stream = null;
  let busy = false;
  const events = []; // progress/metric events with numbers, for the chart
  let latest = {}; // the latest progress data

  function renderActions() {
    const buttons = [];
    const active = job && !FINISHED.has(job.status);
    const cancelling = active && job.cancel_requested_at;
    if (active) {
      buttons.push(h('button', { type: 'button', class: 'danger', disabled: busy || Boolean(cancelling), text: cancelling ? 'Cancelling…' : 'Cancel', onclick: () => run('cancel') }));
      if (CHECKPOINTING.has(job.kind) && job.status === 'running') {
        buttons.push(h('button', { type: 'button', class: 'secondary', disabled: busy || Boolean(cancelling), text: 'Cancel and save', title: 'Finish the step, save a checkpoint, then stop', onclick: () => run('save') }));
      }
    }
    if (job && CHECKPOINTING.has(job.kind) && (job.status === 'interrupted' || job.status === 'cancelled')) {
      buttons.push(h('button', { type: 'button', class: 'primary', disabled: busy, text: 'Resume', onclick: () => run('resume') }));
    }
    if (job && FINISHED.has(job.status)) {
      buttons.push(h('button', { type: 'button', class: 'secondary', disabled: busy, text: 'Delete', onclick: () => run('delete') }));
    }
    replace(actions, buttons);
  }

  async function run(action) {
    if (action === 'delete' && !confirm(`Delete ${jobId} and its log?`)) return;
    busy = true;
    renderActions();
    replace(actionError);
    try {
      if (action === 'cancel') job = await postJson(url('/cancel'), {});
      else if (action === 'save') job = await postJson(url('/cancel'), { save: true });
      else if (action === 'resume') { job = await postJson(url('/resume'), {}); openStream(); }
      else if (action === 'delete') { await del(url()); location.hash = '#/jobs'; return; }
    } catch (err) {
      replace(actionError, errorBox(err, `Could not ${action === 'save' ? 'cancel and save' : action}`));
    } finally {
      busy = false;
    }
    render();
  }

  function render() {
    if (!job) return;
    replace(statusHost, badge(job.status), h('span', { class: 'tag', text: job.kind }));
    renderActions();
    const pct = `${Math.round((job.progress ?? 0) * 100)}%`;
    replace(summary,
      h('div', { class: 'row' }, h('h2', { text: 'Progress' }), h('span', { class: 'spacer' }), h('strong', { class: 'pct', text: pct })),
      progressBar(job.progress, 'job progress'),
      h('p', { class: 'stage', text: [job.stage, job.message].filter(Boolean).join(' · ') || (job.status === 'queued' ? 'Waiting for its turn…' : ' ') }),
      job.error ? h('div', { class: 'notice error', role: 'alert' }, h('strong', { text: 'Error: ' }), job.error) : null,
      h('dl', { class: 'facts' },
        h('dt', { text: 'Created' }), h('dd', { text: formatTime(job.created_at) }),
        h('dt', { text: 'Started' }), h('dd', { text: formatTime(job.started_at) }),
        h('dt', { text: 'Finished' }), h('dd', { text: formatTime(job.finished_at) }),
        h('dt', { text: 'Ran for' }), h('dd', { text: jobDuration(job) }),
        h('dt', { text: 'Attempt' }), h('dd', { text: String(job.attempt) }),
        h('dt', { text: 'Priority' }), h('dd', { text: String(job.priority) }),
        job.exit_code !== null ? [h('dt', { text: 'Exit code' }), h('dd', { text: String(job.exit_code) })] : null));
    if (job.result) {
      resultCard.hidden = false;
      replace(resultCard, h('h2', { text: 'Result' }), h('pre', { class: 'json', text: JSON.stringify(job.result, null, 2) }));
    }
    replace(paramsCard, h('h2', { text: 'Parameters' }), h('dl', { class: 'facts params' },
      Object.entries(job.params).map(([k, v]) => [h('dt', { text: k }), h('dd', {}, h('code', { text: typeof v === 'string' ? v : JSON.stringify(v) }))])));
  }

  // Cheap updates between full renders: the bar, the percentage and the stage line.
  function renderProgress() {
    const bar = summary.querySelector('progress');
    if (!bar || !job) return;
    bar.value = job.progress ?? 0;
    summary.querySelector('.pct').textContent = `${Math.round((job.progress ?? 0) * 100)}%`;
  }

  const renderChart = throttle(() => {
    const series = lossSeries(events);
    const any = series.some((s) => s.points.length);
    chartCard.hidden = !any && !CHECKPOINTING.has(job?.kind);
    if (!chartCard.hidden) replace(chartCard, h('h2', { text: 'Loss' }), lineChart(series));
    const shown = METRICS.filter(([k]) => latest[k] !== undefined && latest[k] !== null);
    metricsCard.hidden = !shown.length;
    if (shown.length) {
      replace(metricsCard, h('h2', { text: 'Metrics' }), h('dl', { class: 'metrics' },
        shown.map(([k, label]) => h('div', {}, h('dt', { text: label }), h('dd', { text: metricText(k, latest[k]) })))));
    }
  }, 250);

  let refreshError = null; // shown until a refresh works again
  const refreshJob = throttle(async () => {
    try {
      job = await getJson(url());
      refreshError?.remove();
      refreshError = null;
      render();
    } catch (err) {
      // A finished job's state came with the stream's end: nothing is stale.
      if (job && FINISHED.has(job.status)) return;
      refreshError = errorBox(err, 'Could not refresh the job');
      replace(actionError, refreshError);
    }
  }, 300);

  const refreshLog = throttle(async () => {
    try {
      const text = await getText(url(`/log?tail=${LOG_TAIL_BYTES}`));
      const atBottom = logPre.scrollTop + logPre.clientHeight >= logPre.scrollHeight - 8;
      logPre.textContent = text || '(no output yet)';
      if (atBottom) logPre.scrollTop = logPre.scrollHeight; // follow the tail unless scrolled up
    } catch {
      // the log is optional; status errors are shown elsewhere
    }
  }, 1000);

  function onEvent(msg) {
    let ev;
    try { ev = JSON.parse(msg.data); } catch { return; }
    if (msg.event === 'end') {
      job = ev;
      render();
      refreshLog();
      return;
    }
    const data = ev.data || {};
    if (!job) return;
    if (msg.event === 'progress' || msg.event === 'metric') {
      if (typeof data.progress === 'number') job.progress = data.progress;
      latest = { ...latest, ...data };
      if (typeof data.loss === 'number' || typeof data.eval_loss === 'number') events.push(ev);
      renderProgress();
      renderChart();
      return;
    }
    if (msg.event === 'log') refreshLog();
    else refreshJob(); // started, stage, status: the job row changed
  }

  function openStream() {
    const lastId = stream?.lastId ?? null;
    stream?.close();
    stream = new EventStream(url('/events'), {
      onEvent,
      onState: (state, err) => {
        streamState.textContent = STREAM_LABELS[state] || state;
        streamState.dataset.state = state;
        if (state === 'error') replace(actionError, errorBox(err, 'Live updates stopped'));
        if (state === 'live') refreshJob(); // catch up on fields events don't carry
      },
    });
    stream.lastId = lastId;
    stream.start();
  }

  getJson(url()).then((j) => {
    job = j;
    render();
    refreshLog();
    openStream();
  }).catch((err) => {
    replace(summary, errorBox(err, err.status === 404 ? 'No such job' : 'Could not load the job'));
    streamState.hidden = true;
  });

  const logTimer = setInterval(() => { if (job && !FINISHED.has(job.status)) refreshLog(); }, 3000);
  return () => { stream?.close(); clearInterval(logTimer); };
}
