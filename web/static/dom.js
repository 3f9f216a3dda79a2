// Small DOM and formatting helpers. Elements are built with h(), never from
// HTML strings, so text from the API can never become markup.

export function h(tag, props = null, ...children) {
  const el = document.createElement(tag);
  if (props) {
    for (const [key, value] of Object.entries(props)) {
      if (value === null || value === undefined || value === false) continue;
      if (key === 'class') el.className = value;
      else if (key === 'text') el.textContent = value;
      else if (key === 'dataset') Object.assign(el.dataset, value);
      else if (key.startsWith('on') && typeof value === 'function') el.addEventListener(key.slice(2), value);
      else if (key in el && (typeof value !== 'string' || key === 'value')) el[key] = value; // properties (value, checked, rows)
      else el.setAttribute(key, value === true ? '' : String(value));
    }
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

// SVG elements need their namespace.
export function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) el.setAttribute(key, String(value));
  }
  append(el, children);
  return el;
}

export function badge(state, label = state) {
  return h('span', { class: `badge state-${state}`, text: label });
}

export function progressBar(fraction, label) {
  const bar = h('progress', { max: 1, value: Math.max(0, Math.min(1, fraction ?? 0)) });
  bar.setAttribute('aria-label', label || 'progress');
  return bar;
}

export function formatBytes(n) {
  if (n === null || n === undefined) return '—';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return '—';
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, '0')}s`;
  const hrs = Math.floor(m / 60);
  if (hrs < 48) return `${hrs}h ${String(m % 60).padStart(2, '0')}m`;
  return `${Math.floor(hrs / 24)}d ${hrs % 24}h`;
}

export function formatAgo(unixSeconds) {
  if (!unixSeconds) return '—';
  return `${formatDuration(Date.now() / 1000 - unixSeconds)} ago`;
}

export function formatTime(unixSeconds) {
  if (!unixSeconds) return '—';
  return new Date(unixSeconds * 1000).toLocaleString();
}

export function formatNumber(n, digits = 0) {
  if (n === null || n === undefined || !isFinite(n)) return '—';
  return Number(n).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

export function errorBox(err, prefix = '') {
  const text = err?.message ?? String(err);
  return h('div', { class: 'notice error', role: 'alert' }, prefix ? `${prefix}: ` : '', text);
}

// Element ids made from API strings (model ids may hold '/').
export function safeId(...parts) {
  return parts.join('-').replace(/[^A-Za-z0-9_-]/g, '_');
}

// Tables stack into one card per row on narrow screens (see .stack in the
// CSS): each cell carries its column's name for the label it shows there.
export function stackTable(table) {
  table.classList.add('stack');
  const heads = [...table.querySelectorAll('thead th')].map((th) => th.textContent);
  for (const tr of table.querySelectorAll('tbody tr')) {
    const cells = [...tr.children];
    if (cells.length === 1 && cells[0].colSpan > 1) continue; // a detail row spanning the table
    cells.forEach((td, i) => { if (heads[i]) td.dataset.label = heads[i]; });
  }
  return table;
}

// A button that copies text to the clipboard and says so.
export function copyButton(getText, label = 'Copy') {
  const btn = h('button', { type: 'button', class: 'secondary small copy', text: label });
  btn.addEventListener('click', async () => {
    const text = typeof getText === 'function' ? getText() : getText;
    try {
      await navigator.clipboard.writeText(text);
      btn.textContent = 'Copied';
    } catch {
      // No clipboard (plain http on another host): select the text instead.
      const pre = btn.closest('.code-block')?.querySelector('pre');
      if (pre) getSelection().selectAllChildren(pre);
      btn.textContent = 'Press Ctrl+C';
    }
    setTimeout(() => { btn.textContent = label; }, 1500);
  });
  return btn;
}
