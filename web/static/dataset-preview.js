// A local preview of a dataset file before upload: the first rows and the
// row format they look like, next to the server's template for that format.
import { h } from './dom.js';

const PREVIEW_BYTES = 64 * 1024;
const PREVIEW_ROWS = 3;

export function detectFormat(row) {
  if (typeof row === 'string') return 'text';
  if (!row || typeof row !== 'object') return null;
  if (Array.isArray(row.messages)) return 'messages';
  if (Array.isArray(row.conversations)) return 'sharegpt';
  if ('instruction' in row && 'output' in row) return 'alpaca';
  if (typeof row.text === 'string') return 'text';
  return null;
}

function splitCsv(line, sep) {
  // Enough for a preview: quoted cells with doubled quotes, no embedded newlines.
  const cells = [];
  let cur = '';
  let quoted = false;
  for (let i = 0; i < line.length; i++) {
    const c = line[i];
    if (quoted) {
      if (c === '"' && line[i + 1] === '"') { cur += '"'; i++; } else if (c === '"') quoted = false; else cur += c;
    } else if (c === '"') quoted = true;
    else if (c === sep) { cells.push(cur); cur = ''; } else cur += c;
  }
  cells.push(cur);
  return cells;
}

// {rows, note} parsed from the head of the file.
export async function previewRows(file) {
  const ext = file.name.split('.').pop().toLowerCase();
  if (ext === 'parquet') return { rows: [], note: 'Parquet files are previewed by the job itself.' };
  const text = await file.slice(0, PREVIEW_BYTES).text();
  const lines = text.split(/\r?\n/);
  if (file.size > PREVIEW_BYTES) lines.pop(); // the last line may be cut
  const nonEmpty = lines.filter((l) => l.trim());
  if (ext === 'jsonl' || ext === 'ndjson') {
    const rows = [];
    for (const [i, l] of nonEmpty.slice(0, PREVIEW_ROWS).entries()) {
      try { rows.push(JSON.parse(l)); } catch { return { rows, note: `Line ${i + 1} is not valid JSON.` }; }
    }
    return { rows };
  }
  if (ext === 'json') {
    if (file.size > PREVIEW_BYTES) return { rows: [], note: 'Large JSON arrays are checked by the job itself.' };
    try {
      const data = JSON.parse(text);
      return Array.isArray(data) ? { rows: data.slice(0, PREVIEW_ROWS) } : { rows: [], note: 'Expected a JSON array of rows.' };
    } catch {
      return { rows: [], note: 'The file is not valid JSON.' };
    }
  }
  if (ext === 'csv' || ext === 'tsv') {
    const sep = ext === 'tsv' ? '\t' : ',';
    const [head, ...body] = nonEmpty;
    if (!head) return { rows: [] };
    const cols = splitCsv(head, sep);
    return { rows: body.slice(0, PREVIEW_ROWS).map((l) => Object.fromEntries(splitCsv(l, sep).map((v, i) => [cols[i] ?? `col${i}`, v]))) };
  }
  return { rows: nonEmpty.slice(0, PREVIEW_ROWS) };
}

export function renderPreview(file, { rows, note }, templates) {
  const formats = rows.map(detectFormat);
  const format = formats.length && formats.every((f) => f && f === formats[0]) ? formats[0] : null;
  const template = templates?.find((t) => t.format === format);
  return h('div', { class: 'preview', 'aria-live': 'polite' },
    h('p', { class: 'small' }, h('strong', { text: file.name }), ` · ${(file.size / 1024).toFixed(1)} KiB · `,
      format ? h('span', {}, 'looks like ', h('span', { class: 'tag', text: format })) : h('span', { class: 'warn', text: rows.length ? 'format not recognised' : 'no rows previewed' })),
    note ? h('p', { class: 'small warn', text: note }) : null,
    rows.length ? h('pre', { class: 'rows', text: rows.map((r) => (typeof r === 'string' ? r : JSON.stringify(r))).join('\n') }) : null,
    template ? h('p', { class: 'small muted', text: `${template.format}: ${template.description}` }) : null,
    !format && rows.length && templates
      ? h('details', { class: 'small' }, h('summary', { text: 'Accepted row formats' }),
        h('ul', { class: 'plain' }, templates.map((t) => h('li', {}, h('strong', { text: t.format }), ` — ${t.description}`,
          h('pre', { class: 'rows', text: JSON.stringify(t.example) })))))
      : null);
}
