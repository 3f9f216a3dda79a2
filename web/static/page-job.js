// One job: live status over SSE (resuming with Last-Event-ID), the loss
// chart, the log tail, the result, and cancel / cancel-with-save / resume.
import { connection, cpuOnly, del, getJson, getText, leaseDevices, postJson } from './api.js';
import { lineChart, lossSeries } from './chart.js';
import { badge, errorBox, formatBytes, formatDuration, formatNumber, formatTime, h, progressBar, replace } from './dom.js';
import { listedModelLink } from './listed-model.js';
import { FIELD_LABELS } from './schema.js';
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
// The metrics that are spans of time ("_s" alone says seconds or per second: tokens_per_s).
const DURATIONS = new Set(['elapsed_s', 'eta_s']);

export function metricText(key, value) {
  if (typeof value !== 'number') return String(value);
  if (DURATIONS.has(key)) return formatDuration(value);
  if (key.startsWith('bytes')) return formatBytes(value);
  if (key === 'rate') return `${formatBytes(value)}/s`;
  if (key === 'tokens_per_s') return formatNumber(value, 1);
  if (key.includes('loss')) return value.toFixed(4);
  if (key === 'learning_rate' || key === 'lr') return value.toExponential(2);
  return formatNumber(value, Number.isInteger(value) ? 0 : 2);
}

const base = (path) => String(path ?? '').split('/').filter(Boolean).pop() || '';

// What the job works on, for its title: "quantize · tiny.gguf".
export function jobSubject(job) {
  const p = job.params || {};
  const value = { dataset: p.input, download: p.repo_id, finetune: p.model, export: p.model, quantize: p.model }[job.kind]
    ?? p.model ?? p.input ?? p.repo_id ?? p.tag;
  return job.kind === 'download' ? String(value || '') : base(value);
}

export function jobTitle(job) {
  const subject = jobSubject(job);
  return subject ? `${job.kind} · ${subject}` : `${job.kind} job`;
}

const chatLink = (model) => h('a', { class: 'next-step', href: `#/chat?model=${encodeURIComponent(model)}`, text: 'Chat with this model' });
const jobLink = (kind, params, text) => {
  const q = new URLSearchParams({ new: kind, ...params });
  return h('a', { class: 'next-step', href: `#/jobs?${q}`, text });
};

// "Try it": a fine-tune's adapter served on its base model, in the chat,
// by an engine chosen here, deliberately:
// - vLLM serves the adapter dir as the fine-tune wrote it. The library
//   lists <outputs>/<name>/adapter as adapter <name> on its Hugging Face
//   base; when that base is served by vLLM and usable, the chat opens on
//   <base>:<name> at once, with no export (vllmPair), and asks the chat to
//   start the base's worker while the user types: that start takes 30-60 s
//   on a CPU, which the chat says until the worker serves (chat-start.js).
// - Otherwise (no vLLM environment, a GGUF-only base, or an adapter the
//   vLLM worker refused) the adapter is exported to a GGUF LoRA adapter
//   <name>-lora for llama.cpp, unless it was, and the chat opens on
//   <base>:<name>-lora once the library links it.
const TRY_WAIT_MS = 120000;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// The vLLM pair for a fine-tune's result `r` from an /api/models `body`:
// {pair, base} when its own adapter dir (matched by path, so a model dir's
// adapter of the same name is not taken for it) fits a usable vLLM base
// whose worker did not refuse it; else null.
export function vllmPair(body, r) {
  if (!r.output_dir || !r.adapter_path) return null;
  const adapter = (body.adapters || []).find((a) => a.id === base(r.output_dir) && a.path === r.adapter_path);
  if (!adapter?.usable || adapter.adapter_error) return null;
  const models = new Map((body.data || []).map((m) => [m.id, m]));
  const link = adapter.links.find((l) => l.fits && models.get(l.base)?.engine === 'vllm' && models.get(l.base).usable);
  return link ? { pair: link.model, base: link.base } : null;
}

async function exportedAdapter(r, say, body) {
  if (r.adapter_export?.adapter) return r.adapter_export.adapter;
  if (r.adapter?.adapter) return r.adapter.adapter; // an export job of an adapter
  const name = `${base(r.output_dir)}-lora`;
  if ((body.adapters || []).some((a) => a.id === name)) return name; // exported before
  say('Exporting the adapter for llama.cpp…');
  let job;
  try {
    job = await postJson('api/jobs', { kind: 'export', params: { model: r.adapter_path, output_name: name } });
  } catch (err) {
    if (err.code === 'output_exists') return name; // written, the library lists it soon
    throw err;
  }
  for (const until = Date.now() + TRY_WAIT_MS; Date.now() < until; await sleep(500)) {
    const now = await getJson(`api/jobs/${encodeURIComponent(job.id)}`);
    if (now.status === 'succeeded') return now.result.adapter.adapter;
    if (FINISHED.has(now.status)) throw new Error(`the adapter export ${now.status}: ${now.error || ''}`);
  }
  throw new Error('the adapter export is taking long; see the jobs page');
}

async function pairFor(adapterId, say) {
  say('Waiting for the model library…');
  for (const until = Date.now() + TRY_WAIT_MS; Date.now() < until; await sleep(500)) {
    const body = await getJson('api/models');
    const adapter = (body.adapters || []).find((a) => a.id === adapterId);
    const link = adapter?.links.find((l) => l.fits);
    if (link) return link.model;
    if (adapter && !adapter.usable) throw new Error(adapter.reason);
  }
  throw new Error(`the library never listed adapter ${adapterId}`);
}

// The chat URL for Try it: on vLLM it asks the chat to start the worker.
async function tryItTarget(r, say) {
  const body = await getJson('api/models');
  const live = vllmPair(body, r);
  if (live) {
    say(`vLLM serves ${live.pair} with no export; opening the chat…`);
    return `#/chat?${new URLSearchParams({ model: live.pair, start: '1' })}`;
  }
  const pair = await pairFor(await exportedAdapter(r, say, body), say);
  return `#/chat?${new URLSearchParams({ model: pair })}`;
}

function tryItButton(r) {
  const note = h('span', { class: 'small muted', role: 'status' });
  const button = h('button', { type: 'button', class: 'primary', text: 'Try it', title: 'Serve the adapter on its base model and chat with it' });
  button.addEventListener('click', async () => {
    button.disabled = true;
    try {
      window.location.hash = await tryItTarget(r, (t) => { note.textContent = t; });
    } catch (err) {
      replace(note, errorBox(err, 'Try it failed'));
      button.disabled = false;
    }
  });
  return h('span', { class: 'try-it' }, button, ' ', note);
}

// A person's reading of the result: what came out, and where to go next.
export function resultSummary(job, checks = new Map()) {
  const r = job.result || {};
  const lines = [];
  const next = [];
  if (job.kind === 'quantize') {
    lines.push(['Model', h('code', { text: r.model ?? base(r.output_path) })], ['Type', r.type], ['Size', formatBytes(r.bytes)]);
    if (r.input_bytes) lines.push(['Input size', `${formatBytes(r.input_bytes)} (now ${Math.round((100 * r.bytes) / r.input_bytes)}%)`]);
    if (r.seconds !== undefined) lines.push(['Took', formatDuration(r.seconds)]);
    if (r.model) next.push(chatLink(r.model));
  } else if (job.kind === 'export' && r.adapter) {
    lines.push(['Adapter', h('code', { text: r.adapter.adapter })], ['Rank', r.adapter.rank], ['Size', formatBytes(r.adapter.bytes)]);
    next.push(tryItButton(r));
  } else if (job.kind === 'export') {
    const out = r.quantized || r.converted || {};
    lines.push(['Model', h('code', { text: r.model })]);
    if (out.bytes !== undefined) lines.push(['Size', formatBytes(out.bytes)]);
    if (r.model) next.push(chatLink(r.model), jobLink('quantize', { model: r.model }, 'Quantize it'));
  } else if (job.kind === 'dataset') {
    const rows = r.rows || {};
    lines.push(['Format', r.format], ['Rows kept', `${formatNumber(rows.kept)} of ${formatNumber(rows.read)} read`],
      ['Split', `${formatNumber(rows.train)} train · ${formatNumber(rows.eval)} eval`]);
    if (rows.bad || rows.duplicates) lines.push(['Dropped', `${formatNumber(rows.bad)} bad · ${formatNumber(rows.duplicates)} duplicate`]);
    if (r.train_path) lines.push(['Train file', h('code', { text: base(r.train_path) })]);
    if (r.eval_path) lines.push(['Eval file', h('code', { text: base(r.eval_path) })]);
    if (r.train_path) {
      const params = { train: r.train_path };
      if (r.eval_path && rows.eval) params.eval = r.eval_path;
      next.push(jobLink('finetune', params, 'Fine-tune on this dataset'));
    }
  } else if (job.kind === 'download') {
    const files = r.files || [];
    lines.push(['Repository', r.repo_id], ['Files', `${files.length} (${formatBytes(files.reduce((n, f) => n + (f.size || 0), 0))})`],
      ['Downloaded', formatBytes(r.bytes_downloaded)]);
    if (r.bytes_reused) lines.push(['Already there', formatBytes(r.bytes_reused)]);
    // Linked only once /v1/models lists it: a download is not yet a served model.
    if (r.model_id) { lines.push(['Model', h('code', { text: r.model_id })]); next.push(listedModelLink(r.model_id, r.repo_id, chatLink, checks)); }
  } else if (job.kind === 'finetune') {
    if (r.output_dir) lines.push(['Output', h('code', { text: r.output_dir })]);
    if (r.adapter_path) lines.push(['Adapter', h('code', { text: base(r.adapter_path) })]);
    if (r.adapter_export?.adapter) lines.push(['GGUF adapter', h('code', { text: r.adapter_export.adapter })]);
    if (r.adapter_path) next.push(tryItButton(r));
    if (r.merged_path) { lines.push(['Merged model', h('code', { text: base(r.merged_path) })]); }
    if (r.export?.model) next.push(chatLink(r.export.model));
    else if (r.merged_path) next.push(jobLink('export', { model: r.merged_path }, 'Export to GGUF'));
  } else {
    for (const [k, v] of Object.entries(r)) {
      if (v === null || typeof v === 'object') continue;
      lines.push([FIELD_LABELS[k] || k, /bytes/.test(k) && typeof v === 'number' ? formatBytes(v) : String(v)]);
    }
  }
  const shown = lines.filter(([, v]) => v !== undefined && v !== null && v !== '');
  return h('div', { class: 'result-summary' },
    shown.length ? h('dl', { class: 'facts' }, shown.map(([k, v]) => [h('dt', { text: k }), h('dd', {}, v)])) : null,
    next.length ? h('p', { class: 'next-steps' }, h('strong', { text: 'Next: ' }), next.flatMap((a, i) => (i ? [' · ', a] : [a]))) : null);
}

// The parameters as a person reads them. On a machine without a GPU the
// lease's only device is `cpu`: the job runs there, whatever `gpus` counts.
export function paramFacts(params, deviceIds) {
  const noGpu = cpuOnly(deviceIds);
  const value = (v) => (v === null ? h('span', { class: 'muted', text: '—' }) : h('code', { text: typeof v === 'string' ? v : JSON.stringify(v) }));
  return Object.entries(params).flatMap(([k, v]) => {
    if (noGpu && k === 'gpu_ids') return [];
    if (noGpu && k === 'gpus') {
      return [h('dt', { text: 'Device', title: 'this machine has no GPU' }), h('dd', {}, h('code', { text: 'cpu' }), h('span', { class: 'muted', text: ' · no GPU here' }))];
    }
    return [h('dt', { text: FIELD_LABELS[k] || k, title: k }), h('dd', {}, value(v))];
  });
}

// Between start and finish: a clock the page ticks.
function elapsed(job) {
  if (!job.started_at) return null;
  return (job.finished_at ?? Date.now() / 1000) - job.started_at;
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
  const idLine = h('code', { class: 'job-id small muted', text: jobId });
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
    h('div', { class: 'page-head job-head' }, h('div', { class: 'job-title' }, title, idLine), statusHost, streamState, h('span', { class: 'spacer' }), actions),
    actionError,
    h('div', { class: 'job-grid' },
      h('div', { class: 'col' }, summary, chartCard, metricsCard, logCard),
      h('div', { class: 'col' }, resultCard, paramsCard)));

  let job = null;
  let stream = null;
  let busy = false;
  let deviceIds = []; // the lease's devices, once read
  const events = []; // progress/metric events with numbers, for the chart
  let latest = {}; // the latest progress data
  const listChecks = new Map(); // whether /v1/models lists a result's model, asked once per page

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

  function stageText() {
    if (job.status === 'queued') return [job.stage, job.message].filter(Boolean).join(' · ') || 'Waiting for its turn…';
    if (job.status === 'running') return [job.stage, job.message].filter(Boolean).join(' · ') || 'Running…';
    // Finished: the last stage ("waiting for cpu") is history, only the outcome counts.
    const outcome = { succeeded: 'Finished', failed: 'Failed', cancelled: 'Cancelled', interrupted: 'Interrupted' }[job.status];
    return [outcome, job.status === 'succeeded' ? job.message : null].filter(Boolean).join(' · ');
  }

  function durationFacts() {
    const secs = elapsed(job);
    if (job.status === 'queued') return [h('dt', { text: 'Queued for' }), h('dd', { class: 'duration', text: formatDuration(Date.now() / 1000 - job.created_at) })];
    if (secs === null) return null;
    return [h('dt', { text: FINISHED.has(job.status) ? 'Ran for' : 'Running for' }), h('dd', { class: 'duration', text: formatDuration(secs) })];
  }

  function render() {
    if (!job) return;
    title.textContent = jobTitle(job);
    document.title = `${jobTitle(job)} — gpuvisor`;
    replace(statusHost, badge(job.status), h('span', { class: 'tag', text: job.kind }));
    renderActions();
    const pct = `${Math.round((job.progress ?? 0) * 100)}%`;
    replace(summary,
      h('div', { class: 'row' }, h('h2', { text: 'Progress' }), h('span', { class: 'spacer' }), h('strong', { class: 'pct', text: pct })),
      progressBar(job.progress, 'job progress'),
      h('p', { class: 'stage', text: stageText() || ' ' }),
      job.error ? h('div', { class: 'notice error job-error', role: 'alert' }, h('strong', { text: 'Error: ' }), job.error) : null,
      h('dl', { class: 'facts' },
        h('dt', { text: 'Created' }), h('dd', { text: formatTime(job.created_at) }),
        h('dt', { text: 'Started' }), h('dd', { text: formatTime(job.started_at) }),
        FINISHED.has(job.status) ? [h('dt', { text: 'Finished' }), h('dd', { text: formatTime(job.finished_at) })] : null,
        durationFacts(),
        // The cluster node it names (or its devices do); none: this machine.
        job.node ? [h('dt', { text: FINISHED.has(job.status) ? 'Ran on' : 'Runs on' }), h('dd', { class: 'job-node', text: `node ${job.node}` })] : null,
        h('dt', { text: 'Attempt' }), h('dd', { text: String(job.attempt) }),
        h('dt', { text: 'Priority' }), h('dd', { text: String(job.priority) }),
        job.exit_code !== null ? [h('dt', { text: 'Exit code' }), h('dd', { text: String(job.exit_code) })] : null));
    if (job.result) {
      resultCard.hidden = false;
      replace(resultCard, h('h2', { text: 'Result' }), resultSummary(job, listChecks),
        h('details', { class: 'raw-result' }, h('summary', { text: 'Raw result (JSON)' }), h('pre', { class: 'json', text: JSON.stringify(job.result, null, 2) })));
    }
    replace(paramsCard, h('h2', { text: 'Parameters' }), h('dl', { class: 'facts params' }, paramFacts(job.params, deviceIds)));
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
      logPre.textContent = text || (job && FINISHED.has(job.status) ? 'The job wrote nothing to its log.' : '(no output yet)');
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

  leaseDevices().then((ids) => { deviceIds = ids; render(); });
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
  // The duration ticks while the job waits or runs.
  const clock = setInterval(() => {
    if (!job || FINISHED.has(job.status)) return;
    const dd = summary.querySelector('dd.duration');
    const secs = job.status === 'queued' ? Date.now() / 1000 - job.created_at : elapsed(job);
    if (dd && secs !== null) dd.textContent = formatDuration(secs);
  }, 1000);
  // A refresh that failed while the service was away is retried when it is
  // back, so its error does not outlive the outage.
  const onOnline = () => {
    if (!refreshError) return;
    refreshError.remove();
    refreshError = null;
    refreshJob();
  };
  connection.addEventListener('online', onOnline);
  return () => {
    stream?.close(); clearInterval(logTimer); clearInterval(clock);
    connection.removeEventListener('online', onOnline);
  };
}
