// Overview: what the workstation is doing right now. Polls the service,
// the GPU lease, the models and the active jobs.
import { getJson } from './api.js';
import { badge, errorBox, formatBytes, formatDuration, h, progressBar, replace, stackTable } from './dom.js';
import { poll } from './poll.js';

const LOADED_MODEL_STATES = new Set(['starting', 'ready', 'draining', 'stopping']);
const BROKEN_MODEL_STATES = new Set(['crashed', 'failed']);
export const DEMO_MODEL = 'tiny-random-demo';
// Its Hugging Face form, written beside it to fine-tune offline.
export const DEMO_HF_MODEL = 'tiny-random-demo-hf';
// Small, well-known GGUF repos to start with.
export const STARTER_REPOS = ['ggml-org/gemma-3-270m-it-GGUF', 'Qwen/Qwen2.5-0.5B-Instruct-GGUF', 'bartowski/SmolLM2-360M-Instruct-GGUF'];

export function keepAliveText(model, now = Date.now() / 1000) {
  const at = model.keep_alive_expires_at;
  if (at === null || at === undefined) return model.state === 'ready' ? 'kept loaded' : '—';
  const left = at - now;
  return left > 0 ? `unloads in ${formatDuration(left)}` : 'unloading when idle';
}

function card(title, body, extra = null) {
  return h('section', { class: 'card', 'aria-label': title }, h('div', { class: 'card-head' }, h('h2', { text: title }), extra), body);
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? '' : 's'}`;
}

// /healthz says the service is up; a failed or crash-looping model is still
// something to fix, so the status says so instead of "ok".
export function serviceStatus(health, models) {
  const failed = (models || []).filter((m) => m.state === 'failed').length;
  const crashed = (models || []).filter((m) => m.state === 'crashed').length;
  // "degraded" means a model failed: named below, with the count.
  if (health.status !== 'ok' && health.status !== 'degraded') return { state: 'failed', text: health.status };
  if (failed) return { state: 'failed', text: `${plural(failed, 'model')} failed` };
  if (crashed) return { state: 'crashed', text: `${plural(crashed, 'model')} restarting after a crash` };
  return { state: 'ready', text: 'ok' };
}

function serviceCard(health, version, models) {
  if (!health) return card('Service', h('p', { class: 'muted', text: 'Loading…' }));
  const status = serviceStatus(health, models);
  return card('Service', h('dl', { class: 'facts' },
    h('dt', { text: 'Status' }), h('dd', {}, badge(status.state, status.text),
      status.state !== 'ready' && models?.length ? [' ', h('a', { href: '#/models', class: 'small service-problem', text: 'see Models' })] : null),
    h('dt', { text: 'Version' }), h('dd', { text: version || '—' }),
    h('dt', { text: 'Uptime' }), h('dd', { class: 'uptime', text: formatDuration(health.uptime_s) }),
    h('dt', { text: 'Workers' }), h('dd', { text: String(health.workers?.length ?? 0) })));
}

function deviceRow(d) {
  return h('div', { class: 'device' },
    h('div', { class: 'row' },
      h('strong', { text: d.name || d.id }), h('span', { class: 'muted', text: d.id }),
      d.memory_total_mib ? h('span', { class: 'muted', text: formatBytes(d.memory_total_mib * 1048576) }) : null,
      d.memory ? h('span', { class: 'muted', text: `${formatBytes(d.memory.free_mib * 1048576)} free` }) : null,
      h('span', { class: 'spacer' }), badge(d.state)),
    d.holder
      ? h('p', { class: 'small' }, `${d.state === 'holding' ? 'Held' : 'Being freed'} for `,
        h('a', { href: `#/jobs/${encodeURIComponent(d.holder.job_id)}`, text: d.holder.label || d.holder.job_id }),
        ` · ${formatDuration(d.holder.state_for_s)}`)
      : h('p', { class: 'small muted', text: d.workers?.length
        ? `Free for model workers; running: ${d.workers.join(', ')}.` : 'Free: model workers may use it.' }));
}

// With a cluster configured, each node's GPUs under its name, after this machine's own.
function deviceGroups(devices) {
  if (!devices.some((d) => d.node)) return devices.map(deviceRow);
  const groups = new Map();
  for (const d of devices) {
    const key = d.node || '';
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(d);
  }
  return [...groups].map(([node, ds]) => h('div', { class: 'node-devices' },
    h('h3', { text: node ? `Node ${node}` : 'This machine (jobs)' }), ds.map(deviceRow)));
}

function gpuCard(gpu) {
  if (!gpu) return card('GPU lease', h('p', { class: 'muted', text: 'Loading…' }));
  const devices = deviceGroups(gpu.devices);
  const waiters = gpu.waiters.length
    ? h('div', {}, h('h3', { text: 'Waiting' }), h('ul', { class: 'plain' }, gpu.waiters.map((w) => h('li', { class: 'small' },
      h('a', { href: `#/jobs/${encodeURIComponent(w.job_id)}`, text: w.label || w.job_id }),
      ` wants ${w.devices.join(', ')} · priority ${w.priority} · waiting ${formatDuration(w.waited_s)}`))))
    : h('p', { class: 'small muted', text: 'Nobody is waiting.' });
  // The machine has GPUs the installed engine build cannot use.
  const engine = gpu.engine && gpu.engine.warning
    ? h('p', { class: 'notice warning engine-warning', role: 'status', text: gpu.engine.warning })
    : null;
  return card('GPU lease', [engine, devices, waiters]);
}

function modelsCard(models) {
  if (!models) return card('Loaded models', h('p', { class: 'muted', text: 'Loading…' }));
  const loaded = models.filter((m) => LOADED_MODEL_STATES.has(m.state));
  const broken = models.filter((m) => BROKEN_MODEL_STATES.has(m.state));
  const link = h('a', { href: '#/models', class: 'small', text: 'All models' });
  // A model that failed holds no memory: it is listed apart, with why.
  const failures = broken.length ? h('div', { class: 'failed-models' },
    h('h3', { text: 'Failed models' }),
    h('ul', { class: 'plain' }, broken.map((m) => h('li', { dataset: { failedModel: m.id } },
      h('div', { class: 'row' }, h('code', { text: m.id }), badge(m.state, m.state === 'crashed' ? 'restarting' : 'failed')),
      h('p', { class: 'small model-reason', text: m.reason || 'no reason given' }))))) : null;
  if (!loaded.length) {
    return card('Loaded models', [h('p', { class: 'empty', text: 'No model is loaded. Models load on first use, or from the Models page.' }), failures], link);
  }
  const rows = loaded.map((m) => h('tr', { dataset: { model: m.id } },
    h('td', {}, h('code', { text: m.id })),
    h('td', {}, badge(m.state), m.load ? progressBar(m.load.progress, `loading ${m.id}`) : null),
    h('td', { text: m.fit ? formatBytes(m.fit.needed_bytes) : formatBytes(m.size_bytes) }),
    h('td', { text: m.worker?.n_ctx ? String(m.worker.n_ctx) : '—' }),
    h('td', { class: 'keepalive', dataset: { expires: m.keep_alive_expires_at ?? '', state: m.state }, text: keepAliveText(m) }),
    h('td', { text: m.worker ? `${m.worker.in_flight} / ${m.worker.queued}` : '—' })));
  return card('Loaded models', [h('div', { class: 'table-wrap' }, stackTable(h('table', { class: 'loaded' },
    h('thead', {}, h('tr', {}, ['Model', 'State', 'Memory', 'Context', 'Keep-alive', 'Busy / queued'].map((t) => h('th', { text: t })))),
    h('tbody', {}, rows)))), failures], link);
}

// Only the demo model (or nothing): say what it is and how to add a real one.
function gettingStarted(models) {
  if (!models) return null;
  const real = models.filter((m) => m.id !== DEMO_MODEL && m.id !== DEMO_HF_MODEL);
  if (real.length) return null;
  const demo = models.find((m) => m.id === DEMO_MODEL);
  const dir = demo?.source === 'dir' && demo.path ? demo.path.replace(/\/[^/]*$/, '') : null;
  const cmd = (text) => h('li', {}, h('code', { text }));
  return h('section', { class: 'card getting-started', 'aria-label': 'Getting started' },
    h('h2', { text: 'Add a real model' }),
    demo
      ? h('p', {}, h('code', { text: DEMO_MODEL }),
        ' is a tiny demo model with random weights that gpuvisor writes so there is something to try: it loads in a moment and its answers are gibberish.',
        models.some((m) => m.id === DEMO_HF_MODEL) ? [' ', h('code', { text: DEMO_HF_MODEL }), ' is the same model in Hugging Face form, to fine-tune with no download.'] : null)
      : h('p', { text: 'There is no model yet.' }),
    h('p', {}, 'Put GGUF files into ', dir ? h('code', { class: 'models-dir', text: dir }) : 'the models directory',
      ', or pull one from the Hugging Face Hub from a shell in the gpuvisor checkout:'),
    h('ul', { class: 'plain commands' }, STARTER_REPOS.map((r) => cmd(`.venv/bin/gpuvisor pull ${r}`))),
    h('p', { class: 'small muted' }, 'Add ', h('code', { text: ':Q4_K_M' }), ' to a repo to pick a quantization. Or use ',
      h('a', { href: '#/models', text: 'Pull from the Hub' }), ' on the Models page. New files show up by themselves.'));
}

function jobsCard(jobs) {
  if (!jobs) return card('Active jobs', h('p', { class: 'muted', text: 'Loading…' }));
  const link = h('a', { href: '#/jobs', class: 'small', text: 'All jobs' });
  if (!jobs.length) return card('Active jobs', h('p', { class: 'empty', text: 'No job is running or queued.' }), link);
  return card('Active jobs', h('ul', { class: 'plain job-mini' }, jobs.map((j) => h('li', {},
    h('div', { class: 'row' }, h('a', { href: `#/jobs/${encodeURIComponent(j.id)}`, text: j.id }),
      h('span', { class: 'muted', text: j.kind }), h('span', { class: 'spacer' }), badge(j.status)),
    progressBar(j.progress, `${j.id} progress`),
    h('p', { class: 'small muted', text: [j.stage, j.message].filter(Boolean).join(' · ') || ' ' })))), link);
}

export function mount(root) {
  const version = document.querySelector('meta[name="gpuvisor-version"]')?.content;
  const grid = h('div', { class: 'cards' });
  const errors = h('div');
  root.append(h('div', { class: 'page-head' }, h('h1', { text: 'Overview' }),
    h('p', { class: 'muted', text: 'The GPU lease, loaded models and running work on this workstation.' })), errors, grid);
  const state = { health: null, gpu: null, models: null, jobs: null };

  function render() {
    replace(grid, gettingStarted(state.models), serviceCard(state.health, version, state.models), gpuCard(state.gpu), modelsCard(state.models), jobsCard(state.jobs));
  }
  render();

  const poller = poll(async () => {
    const results = await Promise.allSettled([
      getJson('healthz'), getJson('api/gpu'), getJson('api/models'),
      getJson('api/jobs?status=running,queued&limit=20'),
    ]);
    const [health, gpu, models, jobs] = results;
    if (health.status === 'fulfilled') state.health = health.value;
    if (gpu.status === 'fulfilled') state.gpu = gpu.value;
    if (models.status === 'fulfilled') state.models = models.value.data;
    if (jobs.status === 'fulfilled') state.jobs = jobs.value.data;
    const failed = results.find((r) => r.status === 'rejected');
    replace(errors, failed ? errorBox(failed.reason, 'Could not refresh') : null);
    render();
  }, 2000);

  // Countdowns tick every second between polls.
  const ticker = setInterval(() => {
    for (const cell of grid.querySelectorAll('td.keepalive')) {
      const expires = cell.dataset.expires;
      cell.textContent = keepAliveText({ keep_alive_expires_at: expires === '' ? null : Number(expires), state: cell.dataset.state });
    }
    if (state.health) {
      const up = grid.querySelector('.uptime');
      if (up) up.textContent = formatDuration((state.health.uptime_s += 1));
    }
  }, 1000);

  return () => { poller.stop(); clearInterval(ticker); };
}
