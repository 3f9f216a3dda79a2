// A small Markdown renderer for model answers. It builds DOM nodes and sets
// text with textContent only: model text never becomes markup, and links
// are kept only for http(s) URLs (opened with rel=noopener).
//
// Covers what chat answers use: headings, paragraphs, bullet and numbered
// lists, block quotes, rules, fenced code blocks (with a Copy button),
// inline code, **bold**, *italic* / _italic_, ~~strike~~ and [links](https://…).
import { copyButton, h } from './dom.js';

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^(\s*)[-*+]\s+(.*)$/;
const ORDERED = /^(\s*)(\d{1,9})[.)]\s+(.*)$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;

export function safeUrl(raw) {
  try {
    const url = new URL(raw);
    return url.protocol === 'http:' || url.protocol === 'https:' ? url.href : null;
  } catch {
    return null;
  }
}

// Inline spans: code first (its content is literal), then links, then emphasis.
const INLINE = [
  { re: /`([^`\n]+)`/, make: (m) => h('code', { text: m[1] }) },
  {
    re: /\[([^\]\n]+)\]\(([^)\s]+)\)/,
    make: (m) => {
      const href = safeUrl(m[2]);
      return href ? h('a', { href, target: '_blank', rel: 'noopener noreferrer' }, inline(m[1])) : document.createTextNode(m[0]);
    },
  },
  {
    re: /\bhttps?:\/\/[^\s<>()]+[^\s<>().,;:!?'"]/,
    make: (m) => h('a', { href: safeUrl(m[0]) || '#', target: '_blank', rel: 'noopener noreferrer', text: m[0] }),
  },
  { re: /\*\*(?=\S)([^*]+?)\*\*|__(?=\S)([^_]+?)__/, make: (m) => h('strong', {}, inline(m[1] ?? m[2])) },
  { re: /~~(?=\S)([^~]+?)~~/, make: (m) => h('del', {}, inline(m[1])) },
  { re: /\*(?=\S)([^*\n]+?)\*|(?<![\w])_(?=\S)([^_\n]+?)_(?![\w])/, make: (m) => h('em', {}, inline(m[1] ?? m[2])) },
];

export function inline(text) {
  const out = [];
  let rest = text;
  while (rest) {
    let best = null;
    for (const rule of INLINE) {
      const m = rule.re.exec(rest);
      if (m && (best === null || m.index < best.m.index)) best = { m, rule };
    }
    if (!best) { out.push(document.createTextNode(rest)); break; }
    if (best.m.index) out.push(document.createTextNode(rest.slice(0, best.m.index)));
    out.push(best.rule.make(best.m));
    rest = rest.slice(best.m.index + best.m[0].length);
  }
  return out;
}

function codeBlock(code, lang) {
  const pre = h('pre', {}, h('code', { text: code, class: lang ? `lang-${lang}` : null }));
  return h('div', { class: 'code-block' },
    h('div', { class: 'code-head' }, h('span', { class: 'code-lang', text: lang || 'code' }), copyButton(() => code)),
    pre);
}

// Lines of a list, possibly nested by indentation.
function list(lines, start) {
  const first = BULLET.exec(lines[start]) || ORDERED.exec(lines[start]);
  const indent = first[1].length;
  const ordered = !BULLET.test(lines[start]);
  const el = ordered ? h('ol', { start: Number(first[2]) === 1 ? null : Number(first[2]) }) : h('ul');
  let i = start;
  let item = null;
  let itemText = [];
  const flush = () => { if (item) { item.prepend(...inline(itemText.join(' '))); itemText = []; } };
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      // A blank line ends the list unless another item follows.
      const nextItem = lines[i + 1] && (BULLET.exec(lines[i + 1]) || ORDERED.exec(lines[i + 1]));
      if (nextItem && nextItem[1].length >= indent) { i++; continue; }
      break;
    }
    const m = ordered ? ORDERED.exec(line) : BULLET.exec(line);
    const other = ordered ? BULLET.exec(line) : ORDERED.exec(line);
    const any = m || other;
    if (any && any[1].length > indent && item) {
      flush();
      const [sub, next] = list(lines, i);
      item.append(sub);
      i = next;
      continue;
    }
    if (any && any[1].length < indent) break;
    if (m && m[1].length === indent) {
      flush();
      item = h('li');
      el.append(item);
      itemText = [ordered ? m[3] : m[2]];
      i++;
      continue;
    }
    if (other && other[1].length === indent) break; // a list of the other kind starts
    if (!item || FENCE.test(line) || HEADING.test(line)) break;
    itemText.push(line.trim()); // a continuation line
    i++;
  }
  flush();
  return [el, i];
}

export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  const lines = String(text ?? '').replace(/\r\n?/g, '\n').split('\n');
  let para = [];
  const endPara = () => {
    // A single newline inside a paragraph is a line break, as chat answers mean it.
    if (para.length) frag.append(h('p', {}, para.flatMap((l, n) => (n ? [h('br'), ...inline(l)] : inline(l)))));
    para = [];
  };
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      endPara();
      const body = [];
      i++;
      // An unclosed fence (still streaming) runs to the end.
      while (i < lines.length && !(lines[i].trim().startsWith(fence[1]) && /^\s*[`~]+\s*$/.test(lines[i]))) body.push(lines[i++]);
      i++;
      frag.append(codeBlock(body.join('\n'), fence[2]));
      continue;
    }
    if (!line.trim()) { endPara(); i++; continue; }
    const heading = HEADING.exec(line);
    if (heading) {
      endPara();
      // Answers sit under the page's h1/h2: their headings start at h3.
      frag.append(h(`h${Math.min(6, heading[1].length + 2)}`, { class: 'md-heading' }, inline(heading[2])));
      i++;
      continue;
    }
    if (RULE.test(line)) { endPara(); frag.append(h('hr')); i++; continue; }
    if (BULLET.test(line) || ORDERED.test(line)) {
      endPara();
      const [el, next] = list(lines, i);
      frag.append(el);
      i = next;
      continue;
    }
    if (QUOTE.test(line)) {
      endPara();
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(QUOTE.exec(lines[i++])[1]);
      const quote = h('blockquote');
      quote.append(renderMarkdown(body.join('\n')));
      frag.append(quote);
      continue;
    }
    para.push(line);
    i++;
  }
  endPara();
  return frag;
}
