// Models: the library with load/unload (with options) and load progress,
// each model's LoRA adapters under it (served as <base>:<adapter>, or refused
// with the reason), and a form that pulls a model from the Hub as a download job.
import { ApiError, getJson, modelPath, postJson } from './api.js';
import { badge, errorBox, formatBytes, h, progressBar, replace, safeId, stackTable } from './dom.js';
import { SchemaForm } from './form.js';
import { engineName } from './chat-models.js';
import { keepAliveText } from './page-overview.js';
import { poll } from './poll.js';
import { PRIORITY_FIELD, fieldText, jobKinds } from './schema.js';

const LOADED = new Set(['starting', 'ready', 'draining']);
// A worker that died: its reason and the last lines of its log are shown.
const BROKEN = new Set(['crashed', 'failed']);
// Options of POST /api/models/{id}/load, as a schema for the same form code.
const LOAD_SCHEMA = {
  type: 'object',
  properties: {
    n_ctx: { anyOf: [{ type: 'integer', minimum: 16 }, { type: 'null' }], default: null, description: 'Context length; empty picks the largest that fits.' },
    cache_type: { anyOf: [{ enum: ['f16', 'q8_0', 'q4_0'] }, { type: 'null' }], description: 'KV cache type.' },
    n_gpu_layers: { anyOf: [{ type: 'integer', minimum: -1 }, { type: 'null' }], default: null, description: '-1 offloads every layer.' },
    keep_alive: { anyOf: [{ type: 'string' }, { type: 'null' }], default: null, description: 'e.g. 10m, 1h; 0 unloads after use; -1 keeps it loaded.' },
  },
};

function capabilities(m) {
  const caps = [];
  if (m.supports_tools) caps.push(h('span', { class: 'tag', text: 'tools' }));
  if (m.supports_reasoning) caps.push(h('span', { class: 'tag', text: 'reasoning' }));
  if (m.mmproj) caps.push(h('span', { class: 'tag', text: 'vision' }));
  return caps.length ? caps : h('span', { class: 'muted', text: '—' });
}

function keepAliveValue(raw) {
  // Bare numbers are seconds; anything else ("10m") is a duration string.
  return /^-?\d+(\.\d+)?$/.test(raw) ? Number(raw) : raw;
}

export function mount(root) {
  const tableHost = h('div', { class: 'card' }, h('p', { class: 'muted', text: 'Loading the library…' }));
  const pullHost = h('section', { class: 'card', 'aria-labelledby': 'pull-title' }, h('h2', { id: 'pull-title', text: 'Pull from the Hub' }));
  const downloadsHost = h('div', { class: 'downloads' });
  root.append(
    h('div', { class: 'page-head' }, h('h1', { text: 'Models' }),
      h('p', { class: 'muted', text: 'GGUF models (served by llama.cpp) and Hugging Face safetensors models (served by vLLM) found in the model directories and the Hub cache.' })),
    h('div', { class: 'split' }, tableHost, h('div', { class: 'side' }, pullHost, downloadsHost)));

  let models = null;
  let adapters = []; // /api/models "adapters": each with its candidate bases
  let openLoad = null; // id of the model whose load options are open
  const loadForms = new Map();
  const rowErrors = new Map();

  function loadForm(m) {
    if (!loadForms.has(m.id)) {
      const form = new SchemaForm(safeId('load', m.id), LOAD_SCHEMA, { ...fieldText('load'), submitLabel: 'Load' });
      if (m.context_length) form.field('n_ctx').input.placeholder = `automatic (native ${m.context_length})`;
      form.el.addEventListener('submit', async (ev) => {
        ev.preventDefault();
        const read = form.read();
        if (!read) return;
        const body = read.params;
        if (body.keep_alive !== undefined) body.keep_alive = keepAliveValue(body.keep_alive);
        form.busy(true, 'Loading…');
        const refresh = setInterval(() => poller.now(), 500); // show progress while the call waits
        try {
          await postJson(`api/models/${modelPath(m.id)}/load`, body);
          openLoad = null;
        } catch (err) {
          form.showApiError(err, '');
        } finally {
          clearInterval(refresh);
          form.busy(false, 'Load');
          poller.now();
        }
      });
      loadForms.set(m.id, form);
    }
    return loadForms.get(m.id);
  }

  async function act(m, verb) {
    rowErrors.delete(m.id);
    try {
      if (verb === 'unload') await postJson(`api/models/${modelPath(m.id)}/unload`, {});
      else await postJson(`api/models/${modelPath(m.id)}/load`, {});
    } catch (err) {
      rowErrors.set(m.id, err);
    }
    poller.now();
  }

  // Why the worker died, the end of its log, the whole log, and how to recover.
  function failure(m) {
    const restarting = m.state === 'crashed';
    return h('tr', { class: 'model-failure', dataset: { failedModel: m.id } }, h('td', { colspan: 9 },
      h('div', { class: 'notice error', role: 'status' },
        h('p', { class: 'failure-reason' }, h('strong', { text: restarting ? 'Crashed, restarting: ' : 'Failed: ' }), m.reason || 'no reason given'),
        m.log_tail ? h('pre', { class: 'log', tabindex: 0, 'aria-label': `Last lines of the ${m.id} worker log`, text: m.log_tail }) : null,
        h('p', { class: 'small' },
          h('a', { class: 'worker-log', href: `api/models/${modelPath(m.id)}/log`, target: '_blank', rel: 'noopener', text: 'Open the worker log' }),
          restarting ? ' · it restarts by itself' : ' · fix the cause, then ',
          restarting ? null : h('button', { class: 'secondary small', type: 'button', text: 'Load again', onclick: () => act(m, 'load') })))));
  }

  function row(m) {
    const loaded = LOADED.has(m.state);
    const optsId = safeId('opts', m.id);
    const toggle = h('button', {
      class: 'secondary small', type: 'button', 'aria-expanded': String(openLoad === m.id), 'aria-controls': optsId,
      disabled: !m.usable, text: 'Load…',
      onclick: () => { openLoad = openLoad === m.id ? null : m.id; render(); },
    });
    const actions = loaded
      ? h('button', { class: 'secondary small', type: 'button', text: 'Unload', onclick: () => act(m, 'unload') })
      : toggle;
    const err = rowErrors.get(m.id);
    const rows = [h('tr', { dataset: { model: m.id }, class: BROKEN.has(m.state) ? 'has-failure' : null },
      h('td', {}, h('code', { text: m.id }), m.reason && !m.usable ? h('p', { class: 'small muted', text: m.reason }) : null),
      h('td', { class: 'engine', text: engineName(m) || '—' }),
      h('td', { text: formatBytes(m.size_bytes) }),
      h('td', { text: m.quantization || '—' }),
      h('td', { text: m.architecture || '—' }),
      h('td', { text: m.context_length ? m.context_length.toLocaleString() : '—' }),
      h('td', {}, capabilities(m)),
      h('td', {}, badge(m.state), m.load ? progressBar(m.load.progress, `loading ${m.id}`) : null,
        loaded ? h('p', { class: 'small muted', text: keepAliveText(m) }) : null),
      h('td', { class: 'actions-cell' }, actions))];
    if (BROKEN.has(m.state)) rows.push(failure(m));
    if (err) rows.push(h('tr', { class: 'row-error' }, h('td', { colspan: 9 }, errorBox(err))));
    if (openLoad === m.id && !loaded) {
      rows.push(h('tr', { class: 'load-options', id: optsId }, h('td', { colspan: 9 }, loadForm(m).el)));
    }
    return rows.concat(adapterRows(m));
  }

  // The adapters linked to a base, fitting (a model id of their own) or refused.
  function adapterRows(m) {
    const links = adapters.flatMap((a) => a.links.filter((l) => l.base === m.id).map((l) => [a, l]));
    return links.map(([a, l]) => h('tr', { class: 'adapter-row', dataset: { adapter: l.model } },
      h('td', { colspan: 7 }, h('span', { 'aria-hidden': 'true', text: '↳ ' }), h('code', { text: l.model }),
        h('span', { class: 'small muted', text: ` LoRA adapter ${a.id}${a.rank ? ` · rank ${a.rank}` : ''} · ${formatBytes(a.size_bytes)}` }),
        l.fits ? null : h('p', { class: 'small muted adapter-reason', text: `Refused: ${l.reason}` })),
      h('td', {}, badge(l.fits ? m.state : 'unusable')),
      h('td', { class: 'actions-cell' }, l.fits
        ? h('a', { class: 'small', href: `#/chat?model=${encodeURIComponent(l.model)}`, text: 'Chat' }) : null)));
  }

  // Adapters that no model in the library is a candidate base for.
  function orphans() {
    const alone = adapters.filter((a) => !a.links.length);
    return alone.length ? h('div', { class: 'orphan-adapters' }, h('h3', { text: 'Adapters without a base model' }),
      h('ul', { class: 'plain' }, alone.map((a) => h('li', { dataset: { adapter: a.id } }, h('code', { text: a.id }),
        h('span', { class: 'small muted', text: ` ${a.reason || ''}` }))))) : null;
  }

  function render() {
    if (models === null) return;
    if (!models.length) {
      replace(tableHost, h('p', { class: 'empty', text: 'No models yet. Put GGUF files or Hugging Face model dirs in the models directory, or pull one from the Hub.' }));
      return;
    }
    // Don't redraw under someone typing in a load form (the form itself is kept across redraws).
    const focused = document.activeElement;
    if (focused && tableHost.contains(focused) && focused.matches('input, select, textarea')) return;
    replace(tableHost, h('div', { class: 'table-wrap' }, stackTable(h('table', { class: 'models' },
      h('thead', {}, h('tr', {}, ['Model', 'Engine', 'Size', 'Quant', 'Architecture', 'Context', 'Capabilities', 'State', 'Actions'].map((t) => h('th', { scope: 'col', text: t })))),
      h('tbody', {}, models.map(row)))), orphans()));
  }

  const poller = poll(async () => {
    try {
      const body = await getJson('api/models');
      models = body.data;
      adapters = body.adapters || [];
      render();
    } catch (err) {
      if (models === null) replace(tableHost, errorBox(err, 'Could not list models'));
    }
  }, () => (models?.some((m) => m.state === 'starting') ? 700 : 3000));

  // The pull form is the download kind's schema form.
  jobKinds().then((kinds) => {
    const spec = kinds.find((k) => k.kind === 'download');
    if (!spec) { pullHost.append(h('p', { class: 'muted', text: 'This server has no download job kind.' })); return; }
    const form = new SchemaForm('pull-form', spec.schema, { ...fieldText('download'), extra: PRIORITY_FIELD, submitLabel: 'Pull' });
    form.el.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      const read = form.read();
      if (!read) return;
      form.busy(true, 'Submitting…');
      try {
        await postJson('api/jobs', { kind: 'download', params: read.params, priority: read.extra.priority ?? 0 });
        downloads.now();
      } catch (err) {
        form.showApiError(err);
      } finally {
        form.busy(false, 'Pull');
      }
    });
    pullHost.append(form.el);
  }).catch((err) => pullHost.append(errorBox(err, 'Could not load the job schema')));

  const downloads = poll(async () => {
    try {
      const jobs = (await getJson('api/jobs?kind=download&limit=5')).data;
      replace(downloadsHost, jobs.length ? h('section', { class: 'card' }, h('h2', { text: 'Recent downloads' }),
        h('ul', { class: 'plain job-mini' }, jobs.map((j) => h('li', {},
          h('div', { class: 'row' }, h('a', { href: `#/jobs/${encodeURIComponent(j.id)}`, text: j.params.repo_id || j.id }),
            h('span', { class: 'spacer' }), badge(j.status)),
          progressBar(j.progress, `${j.id} progress`),
          h('p', { class: 'small muted', text: j.error || j.message || j.stage || ' ' }))))) : null);
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
    }
  }, 2000);

  return () => { poller.stop(); downloads.stop(); };
}
