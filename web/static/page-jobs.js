// Jobs: the list with filters, and a submit form per kind built from the
// params schema. The dataset form uploads a file first (with a preview).
import { getJson, postJson, uploadDataset } from './api.js';
import { badge, errorBox, formatAgo, formatDuration, h, progressBar, replace } from './dom.js';
import { renderPreview, previewRows } from './dataset-preview.js';
import { SchemaForm } from './form.js';
import { poll } from './poll.js';
import { FIELD_HINTS, PRIORITY_FIELD, jobKinds } from './schema.js';

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
      h('span', { class: 'small muted', text: j.error ? j.error : j.stage || '' })),
    h('td', { text: formatAgo(j.created_at) }),
    h('td', { text: jobDuration(j) }));
}

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
    h('label', { for: 'dataset-file', text: 'Dataset file' }), input,
    h('p', { class: 'field-help', text: 'JSONL, JSON, CSV/TSV, text or Parquet. It is uploaded into the datasets directory.' }),
    errorEl, preview);
  return {
    el,
    file: () => input.files[0] || null,
    setError: (msg) => { errorEl.textContent = msg; el.classList.toggle('invalid', Boolean(msg)); if (msg) input.focus(); },
  };
}

function submitPanel(kinds, onCreated) {
  const host = h('div');
  // Lab kinds first; test kinds such as sleep last.
  const rank = (k) => { const i = KIND_ORDER.indexOf(k.kind); return i < 0 ? KIND_ORDER.length : i; };
  const all = [...kinds].sort((a, b) => rank(a) - rank(b));
  let current = null;
  const picker = h('div', { class: 'segmented', role: 'radiogroup', 'aria-label': 'Job kind' });

  function show(kind) {
    current = kind;
    for (const b of picker.querySelectorAll('button')) b.setAttribute('aria-checked', String(b.dataset.kind === kind.kind));
    replace(host, buildForm(kind));
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

  function buildForm(kind) {
    const form = new SchemaForm(`submit-${kind.kind}`, kind.schema, { hints: FIELD_HINTS, extra: PRIORITY_FIELD, submitLabel: `Submit ${kind.kind} job` });
    const upload = kind.kind === 'dataset' ? datasetUpload(form) : null;
    if (upload) form.el.prepend(upload.el);
    form.el.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      upload?.setError('');
      const read = form.read();
      if (!read) return;
      form.busy(true, 'Submitting…');
      try {
        if (upload?.file()) {
          form.busy(true, 'Uploading…');
          try {
            const stored = await uploadDataset(upload.file());
            read.params.input = stored.name;
            form.field('input').setValue(stored.name);
          } catch (err) {
            upload.setError(err.message);
            return;
          }
        }
        const job = await postJson('api/jobs', { kind: kind.kind, params: read.params, priority: read.extra.priority ?? 0 });
        onCreated(job);
      } catch (err) {
        form.showApiError(err);
      } finally {
        form.busy(false, `Submit ${kind.kind} job`);
      }
    });
    return h('div', {}, h('p', { class: 'muted small', text: kind.description }), form.el);
  }

  if (all.length) show(all.find((k) => k.kind === 'dataset') || all[0]);
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
      replace(listHost, h('table', { class: 'jobs' },
        h('thead', {}, h('tr', {}, ['Job', 'Kind', 'Status', 'Progress', 'Created', 'Ran for'].map((t) => h('th', { scope: 'col', text: t })))),
        h('tbody', {}, jobs.map(jobRow))));
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
    replace(sideHost, submitPanel(kinds, (job) => { location.hash = `#/jobs/${encodeURIComponent(job.id)}`; }));
  }).catch((err) => replace(sideHost, h('section', { class: 'card' }, errorBox(err, 'Could not load the job kinds'))));

  return () => poller.stop();
}
