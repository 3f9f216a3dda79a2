// Jobs: the list with filters, and a submit form per kind built from the
// params schema. The dataset form uploads a file first (with a preview).
import { cpuOnly, getJson, hasRoute, leaseDevices, postJson, uploadDataset } from './api.js';
import { badge, errorBox, formatAgo, formatBytes, formatDuration, h, progressBar, replace, stackTable } from './dom.js';
import { renderPreview, previewRows } from './dataset-preview.js';
import { attachEstimate } from './finetune-estimate.js';
import { SchemaForm } from './form.js';
import { poll } from './poll.js';
import { PRIORITY_FIELD, fieldText, isTestKind, jobKinds } from './schema.js';

const STATUSES = ['queued', 'running', 'succeeded', 'failed', 'cancelled', 'interrupted'];
const PAGE = 25;
const KIND_ORDER = ['dataset', 'finetune', 'export', 'quantize', 'download'];

export function jobDuration(j) {
  if (!j.started_at) return '—';
  return formatDuration((j.finished_at ?? Date.now() / 1000) - j.started_at);
}

function listUrl(filters, limit, cursor) {
  const q = new URLSearchParams({ limit: String(limit) });
  if (filters.status) q.set('status', filters.status);
  if (filters.kind) q.set('kind', filters.kind);
  if (cursor) q.set('cursor', cursor);
  return `api/jobs?${q}`;
}

function jobRow(j) {
  return h('tr', { dataset: { job: j.id } },
    h('td', {}, h('a', { href: `#/jobs/${encodeURIComponent(j.id)}`, text: j.id })),
    h('td', { text: j.kind }),
    h('td', {}, badge(j.status)),
    h('td', { class: 'progress-cell' }, progressBar(j.progress, `${j.id} progress`),
      // An error's first line: advice of several lines is on the job's page.
      h('span', { class: 'small muted', text: j.error ? j.error.split('\n')[0] : j.stage || '' })),
    h('td', { text: formatAgo(j.created_at) }),
    h('td', { text: jobDuration(j) }));
}

// Dataset files this browser uploaded (the server keeps no list the UI can read
// unless it offers GET /api/datasets).
const UPLOADS_KEY = 'gpuvisor.uploads';
function rememberUpload(name) {
  try {
    const names = JSON.parse(localStorage.getItem(UPLOADS_KEY) || '[]').filter((n) => n !== name);
    localStorage.setItem(UPLOADS_KEY, JSON.stringify([name, ...names].slice(0, 50)));
  } catch {
    // storage full or disabled: only the suggestions suffer
  }
}
function rememberedUploads() {
  try { return JSON.parse(localStorage.getItem(UPLOADS_KEY) || '[]'); } catch { return []; }
}

const base = (path) => String(path).split('/').pop();

// Values to offer in the model and dataset fields, from the library, the
// datasets directory (when listed) and earlier jobs.
async function loadChoices() {
  const [models, datasets, dsJobs, ftJobs] = await Promise.all([
    getJson('api/models').then((b) => b.data).catch(() => []),
    hasRoute('GET', '/api/datasets').then((has) => (has ? getJson('api/datasets').then((b) => b.data) : [])).catch(() => []),
    getJson('api/jobs?kind=dataset&limit=50').then((b) => b.data).catch(() => []),
    getJson('api/jobs?kind=finetune&limit=50').then((b) => b.data).catch(() => []),
  ]);
  const gguf = models.filter((m) => m.usable).map((m) => ({ value: m.id, label: `library model${m.size_bytes ? ` · ${formatBytes(m.size_bytes)}` : ''}` }));
  const files = [
    ...datasets.map((d) => ({ value: d.name, label: d.bytes !== undefined ? `datasets dir · ${formatBytes(d.bytes)}` : 'datasets dir' })),
    ...rememberedUploads().map((n) => ({ value: n, label: 'uploaded here' })),
  ];
  const prepared = [];
  const evals = [];
  for (const j of dsJobs) {
    if (j.params?.input) files.push({ value: base(j.params.input), label: `input of ${j.id}` });
    if (j.status === 'succeeded' && j.result?.train_path) {
      prepared.push({ value: j.result.train_path, label: `train split of ${base(j.params?.input || j.id)}` });
      if (j.result.eval_path) evals.push({ value: j.result.eval_path, label: `eval split of ${base(j.params?.input || j.id)}` });
    }
  }
  const hfDirs = [];
  const hfUsed = [];
  for (const j of ftJobs) {
    if (j.status === 'succeeded' && j.result?.merged_path) hfDirs.push({ value: j.result.merged_path, label: `merged output of ${j.id}` });
    if (j.params?.model) hfUsed.push({ value: j.params.model, label: `used by ${j.id}` });
  }
  return {
    'dataset:input': files,
    'dataset:model': gguf,
    'quantize:model': gguf,
    'finetune:model': hfUsed,
    'finetune:train': [...prepared, ...files.filter((f) => /\.jsonl$/.test(f.value))],
    'finetune:eval': [...evals, ...files.filter((f) => /\.jsonl$/.test(f.value))],
    'export:model': [...hfDirs, ...hfUsed],
  };
}

const TRAIN_COMMAND = 'make install-train';

function trainNotice(reason) {
  return h('div', { class: 'notice warning train-missing', role: 'status' },
    h('strong', { text: 'Fine-tuning is not installed on this server. ' }),
    reason ? h('span', { text: `${reason.replace(/\.?$/, '.')} ` }) : null,
    'Install the train extra in the gpuvisor checkout with ', h('code', { text: TRAIN_COMMAND }), ', then restart gpuvisor.');
}
let trainMissing = null; // the reason, once the server said so (schema or a refused submit)

// The dataset kind's extra field: a file to upload, with a preview.
function datasetUpload(form) {
  const preview = h('div');
  const errorEl = h('p', { class: 'field-error', id: 'dataset-file-error', 'aria-live': 'polite' });
  const input = h('input', { type: 'file', id: 'dataset-file', name: 'file', 'aria-describedby': 'dataset-file-error',
    accept: '.jsonl,.ndjson,.json,.csv,.tsv,.txt,.text,.parquet' });
  const templates = getJson('api/dataset/templates').then((b) => b.data).catch(() => null);
  input.addEventListener('change', async () => {
    errorEl.textContent = '';
    const file = input.files[0];
    if (!file) { replace(preview); return; }
    form.field('input').setValue(file.name);
    replace(preview, renderPreview(file, await previewRows(file), await templates));
  });
  const el = h('div', { class: 'field upload', dataset: { field: 'file' } },
    h('label', { for: 'dataset-file', text: 'Upload a file' }), input,
    h('p', { class: 'field-help', text: 'JSONL, JSON, CSV/TSV, text or Parquet. It is uploaded into the datasets directory.' }),
    errorEl, preview);
  return {
    el,
    file: () => input.files[0] || null,
    clear: () => { input.value = ''; replace(preview); },
    setError: (msg) => { errorEl.textContent = msg; el.classList.toggle('invalid', Boolean(msg)); if (msg) input.focus(); },
  };
}

// A kind's ``node`` (the kinds that book no device): a select of the
// cluster's alive nodes and "this machine" (nothing sent). Hidden without a
// cluster, where the server refuses any node. When the nodes cannot be
// listed (the cluster does not answer), the text field stays, saying why.
// A fine-tune books GPUs, so its Node (``books``) names a node's GPUs: a
// node without one cannot be picked, and without a list there is nothing
// to pick from (its GPUs can still be named in GPU ids).
function nodeChoice(field, clusterNodes, books = false) {
  if (!field) return;
  field.el.hidden = true;
  clusterNodes.then(({ nodes, error }) => {
    if (error) {
      field.el.querySelector('.field-help').textContent = books
        ? `The cluster's nodes could not be listed (${error.message}). To run it on a node, name that node's GPUs in GPU ids (node-b/cuda:0).`
        : `The cluster's nodes could not be listed (${error.message}). Type a node's name, or leave it empty for this machine.`;
      if (books) field.input.disabled = true;
      field.el.hidden = false;
      return;
    }
    if (!nodes) return;
    const gpus = (n) => (n.devices.length ? `${n.devices.length} GPU${n.devices.length === 1 ? '' : 's'}` : 'no GPU');
    field.setOptions([{ value: '', label: 'this machine' }, ...nodes.map((n) => ({ value: n.name, label: `${n.name} · ${gpus(n)}` }))],
      books
        ? "Where the fine-tune runs: this machine, or a node of the cluster, on that node's first GPUs (as many as GPUs asks); paths are the shared directories."
        : 'Where the job runs: this machine, or a node of the cluster (it books no GPU there; paths are the shared directories).');
    if (books) {
      for (const option of field.input.options) {
        option.disabled = Boolean(option.value) && !nodes.find((n) => n.name === option.value)?.devices.length;
      }
    }
    field.el.hidden = false;
  });
}

// A fine-tune on a node: its params with that node's GPUs in gpu_ids (the
// first ``gpus`` of them), as the estimate and the submit both send them;
// {error, field} when the node cannot give what the form asks.
function onNode(params, node, nodes) {
  if (!node) return { params };
  const devices = nodes?.find((n) => n.name === node)?.devices || [];
  if (params.gpu_ids) {
    const elsewhere = params.gpu_ids.filter((id) => !devices.includes(id));
    return elsewhere.length
      ? { error: `GPU ids name ${elsewhere.join(', ')}, not a GPU of node ${node} (${devices.join(', ') || 'none'})`, field: 'gpu_ids' }
      : { params };
  }
  const count = params.gpus ?? 1;
  if (count > devices.length) {
    return { error: `node ${node} has ${devices.length} GPU${devices.length === 1 ? '' : 's'}; GPUs asks ${count}`, field: 'gpus' };
  }
  return { params: { ...params, gpu_ids: devices.slice(0, count) } };
}

function submitPanel(kinds, onCreated, query) {
  const host = h('div');
  // Lab kinds in their usual order; test kinds (sleep) only when asked for.
  const rank = (k) => { const i = KIND_ORDER.indexOf(k.kind); return i < 0 ? KIND_ORDER.length : i; };
  const showTest = query.get('testkinds') === '1' || new URLSearchParams(location.search).get('testkinds') === '1';
  const all = kinds.filter((k) => showTest || !isTestKind(k)).sort((a, b) => rank(a) - rank(b));
  let current = null;
  const picker = h('div', { class: 'segmented', role: 'radiogroup', 'aria-label': 'Job kind' });
  const choices = loadChoices();
  // Without a GPU a count of GPUs, or which ones, is nothing to choose.
  const noGpu = leaseDevices().then(cpuOnly);
  // The cluster's alive nodes, for the kinds that may name one; null: no cluster.
  const clusterNodes = getJson('api/jobs/nodes').then((b) => ({ nodes: b.cluster ? b.data : null }), (error) => ({ error }));
  let listedNodes = null;
  clusterNodes.then(({ nodes }) => { listedNodes = nodes; });

  function show(kind, prefill = {}) {
    current = kind;
    for (const b of picker.querySelectorAll('button')) b.setAttribute('aria-checked', String(b.dataset.kind === kind.kind));
    replace(host, buildForm(kind, prefill));
  }

  for (const k of all) {
    picker.append(h('button', { type: 'button', role: 'radio', dataset: { kind: k.kind }, text: k.kind, title: k.description, onclick: () => show(k) }));
  }
  // Arrow keys move between kinds, as in any radio group.
  picker.addEventListener('keydown', (ev) => {
    if (!['ArrowLeft', 'ArrowRight'].includes(ev.key)) return;
    const i = all.indexOf(current);
    const next = all[(i + (ev.key === 'ArrowRight' ? 1 : all.length - 1)) % all.length];
    show(next);
    picker.querySelector(`[data-kind="${next.kind}"]`).focus();
  });

  function buildForm(kind, prefill) {
    const text = fieldText(kind.kind);
    // A fine-tune takes no node param: its Node choice is the form's own, sent as that node's gpu_ids.
    const booksNode = kind.kind === 'finetune';
    const extra = booksNode ? { ...PRIORITY_FIELD, node: { type: 'string', description: "Where the fine-tune runs: this machine, or a node of the cluster on that node's GPUs." } } : PRIORITY_FIELD;
    const form = new SchemaForm(`submit-${kind.kind}`, kind.schema, { ...text, extra, submitLabel: `Submit ${kind.kind} job` });
    const placed = (params) => onNode(params, booksNode ? form.field('node').read().value : null, listedNodes);
    for (const [name, value] of Object.entries(prefill)) form.field(name)?.setValue(value);
    choices.then((c) => {
      for (const f of form.fields) if (c[`${kind.kind}:${f.name}`]) f.setSuggestions(c[`${kind.kind}:${f.name}`]);
    });
    noGpu.then((only) => {
      if (!only) return;
      for (const name of ['gpus', 'gpu_ids']) {
        const f = form.field(name);
        if (f) f.el.hidden = true;
      }
    });
    nodeChoice(form.field('node'), clusterNodes, booksNode);
    const upload = kind.kind === 'dataset' ? datasetUpload(form) : null;
    if (upload) form.el.prepend(upload.el);
    const noticeHost = h('div', { class: 'kind-notice' });
    const needsTrain = kind.kind === 'finetune' || (kind.kind === 'export' && kind.available === false);
    const showTrain = () => {
      const reason = kind.available === false ? (kind.unavailable_reason || kind.reason || '') : trainMissing;
      replace(noticeHost, needsTrain && (kind.available === false || trainMissing !== null) ? trainNotice(reason) : null);
    };
    showTrain();
    const renameHost = h('div');
    form.el.querySelector('.actions').before(renameHost);
    // In sight above the button, not under "More options": where the job runs.
    const nodeEl = form.field('node')?.el;
    if (nodeEl) form.el.querySelector('.grid').append(nodeEl);
    // What the fine-tune needs per GPU, asked again as the settings change.
    // Above "More options", in sight of the fields first filled in.
    if (kind.kind === 'finetune' && kind.available !== false) (form.moreEl || renameHost).before(attachEstimate(form, placed));
    const label = `Submit ${kind.kind} job`;

    async function submitJob(params, priority) {
      form.busy(true, 'Submitting…');
      try {
        onCreated(await postJson('api/jobs', { kind: kind.kind, params, priority }));
      } catch (err) {
        if (err.code === 'train_extra_missing') {
          trainMissing = err.message.split(/:\s*install/)[0];
          showTrain();
          noticeHost.scrollIntoView({ block: 'nearest' });
        } else {
          form.showApiError(err);
        }
      } finally {
        form.busy(false, label);
      }
    }

    form.el.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      upload?.setError('');
      replace(renameHost);
      const read = form.read();
      if (!read) return;
      const priority = read.extra.priority ?? 0;
      if (upload?.file()) {
        const file = upload.file();
        form.busy(true, 'Uploading…');
        let stored;
        try {
          stored = await uploadDataset(file);
        } catch (err) {
          upload.setError(err.message);
          form.busy(false, label);
          return;
        }
        rememberUpload(stored.name);
        upload.clear();
        read.params.input = stored.name;
        form.field('input').setValue(stored.name);
        if (stored.name !== file.name) {
          // Same name as a file already there: the server kept both. Say so
          // and let the user pick before the job starts (the form is read
          // again then: the user may have changed it, e.g. set overwrite).
          form.busy(false, label);
          const useName = (name) => {
            form.field('input').setValue(name);
            const again = form.read();
            if (!again) return;
            replace(renameHost);
            submitJob({ ...again.params, input: name }, again.extra.priority ?? 0);
          };
          replace(renameHost, h('div', { class: 'notice warning upload-renamed', role: 'status' },
            h('p', {}, h('code', { text: file.name }), ' already exists in the datasets directory, so this upload was stored as ',
              h('code', { text: stored.name }), '.'),
            h('div', { class: 'actions' },
              h('button', { type: 'button', class: 'primary', text: `Use ${stored.name}`, onclick: () => useName(stored.name) }),
              h('button', { type: 'button', class: 'secondary', text: `Use the existing ${file.name}`, onclick: () => useName(file.name) }))));
          return;
        }
      }
      const onIt = placed(read.params);
      if (onIt.error) {
        form.field(onIt.field).setError(onIt.error);
        form.focusFirstError();
        return;
      }
      await submitJob(onIt.params, priority);
    });
    return h('div', {}, h('p', { class: 'muted small kind-description', text: kind.description }), noticeHost, form.el);
  }

  // #/jobs?new=finetune&train=… opens that kind's form filled in.
  const wanted = all.find((k) => k.kind === query.get('new'));
  if (wanted) {
    const prefill = {};
    for (const [key, value] of query) if (key !== 'new' && wanted.schema.properties?.[key]) prefill[key] = value;
    show(wanted, prefill);
  } else if (all.length) {
    show(all.find((k) => k.kind === 'dataset') || all[0]);
  }
  return h('section', { class: 'card', 'aria-labelledby': 'new-job-title' }, h('h2', { id: 'new-job-title', text: 'New job' }), picker, host);
}

export function mount(root, _params, query) {
  const filters = { status: query.get('status') || '', kind: query.get('kind') || '' };
  const listHost = h('div', { class: 'table-wrap' }, h('p', { class: 'muted', text: 'Loading jobs…' }));
  const more = h('button', { type: 'button', class: 'secondary', hidden: true, text: 'Load more' });
  const listError = h('div');
  const statusSel = h('select', { id: 'filter-status', name: 'status' }, h('option', { value: '', text: 'any status' }),
    h('option', { value: 'queued,running', text: 'active' }), STATUSES.map((s) => h('option', { value: s, text: s })));
  const kindSel = h('select', { id: 'filter-kind', name: 'kind' }, h('option', { value: '', text: 'any kind' }));
  statusSel.value = filters.status;
  const sideHost = h('div', { class: 'side' }, h('section', { class: 'card' }, h('p', { class: 'muted', text: 'Loading job kinds…' })));

  root.append(
    h('div', { class: 'page-head' }, h('h1', { text: 'Jobs' }),
      h('p', { class: 'muted', text: 'Dataset preparation, fine-tunes, quantization and downloads, run one process each under the GPU lease.' })),
    h('div', { class: 'split' },
      h('section', { class: 'card', 'aria-label': 'Job list' },
        h('div', { class: 'filters' },
          h('label', { for: 'filter-status', text: 'Status' }), statusSel,
          h('label', { for: 'filter-kind', text: 'Kind' }), kindSel),
        listError, listHost, h('div', { class: 'actions' }, more)),
      sideHost));

  let jobs = [];
  let cursor = null;

  function render() {
    if (!jobs.length) {
      replace(listHost, h('p', { class: 'empty', text: filters.status || filters.kind ? 'No job matches these filters.' : 'No jobs yet. Submit one with the form.' }));
    } else {
      replace(listHost, stackTable(h('table', { class: 'jobs' },
        h('thead', {}, h('tr', {}, ['Job', 'Kind', 'Status', 'Progress', 'Created', 'Ran for'].map((t) => h('th', { scope: 'col', text: t })))),
        h('tbody', {}, jobs.map(jobRow)))));
    }
    more.hidden = !cursor;
  }

  async function refresh() {
    try {
      const page = await getJson(listUrl(filters, Math.max(PAGE, jobs.length)));
      jobs = page.data;
      cursor = page.next_cursor;
      replace(listError);
      render();
    } catch (err) {
      replace(listError, errorBox(err, 'Could not list jobs'));
    }
  }

  function onFilter() {
    filters.status = statusSel.value;
    filters.kind = kindSel.value;
    jobs = [];
    poller.now();
  }
  statusSel.addEventListener('change', onFilter);
  kindSel.addEventListener('change', onFilter);
  more.addEventListener('click', async () => {
    try {
      const page = await getJson(listUrl(filters, PAGE, cursor));
      jobs = jobs.concat(page.data);
      cursor = page.next_cursor;
      render();
    } catch (err) {
      replace(listError, errorBox(err, 'Could not load more jobs'));
    }
  });

  const poller = poll(refresh, 3000);

  jobKinds().then((kinds) => {
    for (const k of kinds) kindSel.append(h('option', { value: k.kind, text: k.kind }));
    kindSel.value = filters.kind;
    replace(sideHost, submitPanel(kinds, (job) => { location.hash = `#/jobs/${encodeURIComponent(job.id)}`; }, query));
  }).catch((err) => replace(sideHost, h('section', { class: 'card' }, errorBox(err, 'Could not load the job kinds'))));

  return () => poller.stop();
}
