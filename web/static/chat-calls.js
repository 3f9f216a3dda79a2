// Hosted tool calls in a chat turn: the tools the server offers
// (/api/hosted-tools), the `tools` a turn sends for the ones switched on, and
// each call the stream reports (code_interpreter, web_search, file_search,
// mcp) with its arguments, its result and how long it ran: from its
// in_progress event to its completed or failed event (or, where the stream
// has no event for a failed run, its output_item.done).
import { getJson } from './api.js';
import { h, replace } from './dom.js';

export const HOSTED_KINDS = ['code_interpreter', 'web_search', 'mcp', 'file_search'];
const CALL_ITEMS = new Set(['code_interpreter_call', 'web_search_call', 'file_search_call', 'mcp_call', 'mcp_list_tools']);
const PHASE = /^response\.(code_interpreter_call|web_search_call|file_search_call|mcp_call|mcp_list_tools)\.(in_progress|interpreting|searching|completed|failed)$/;
const LABELS = {
  code_interpreter: 'Code interpreter', web_search: 'Web search', mcp: 'MCP server', file_search: 'File search',
};
// A saved conversation keeps this much of each call's texts (localStorage is small).
const MAX_SAVED_CHARS = 4000;

// The `tools` (and `include`) of a request for the tools switched on:
// choice = { code_interpreter: true, web_search: true, mcp: {url, label}, file_search: {stores: [...]}}.
export function requestTools(choice) {
  const tools = [];
  const include = [];
  if (choice.code_interpreter) tools.push({ type: 'code_interpreter', container: { type: 'auto' } });
  if (choice.web_search) {
    tools.push({ type: 'web_search' });
    include.push('web_search_call.action.sources', 'web_search_call.results');
  }
  if (choice.mcp?.url) {
    tools.push({ type: 'mcp', server_label: choice.mcp.label || labelOf(choice.mcp.url), server_url: choice.mcp.url, require_approval: 'never' });
  }
  if (choice.file_search?.stores?.length) {
    tools.push({ type: 'file_search', vector_store_ids: choice.file_search.stores });
    include.push('file_search_call.results');
  }
  return { tools, include };
}

// An MCP server label from its URL: letters, digits, _ and - (as OpenAI asks).
export function labelOf(url) {
  try {
    return new URL(url).hostname.replace(/[^A-Za-z0-9_-]/g, '_').slice(0, 64) || 'mcp';
  } catch {
    return 'mcp';
  }
}

// Follow one stream event into `calls` (a list of {id, type, item, started,
// ended}); `now` is a performance.now() reading. True when a call changed.
export function followCall(calls, ev, now) {
  const find = (id) => calls.find((c) => c.id === id);
  if (ev.type === 'response.output_item.added' && CALL_ITEMS.has(ev.item?.type)) {
    calls.push({ id: ev.item.id, type: ev.item.type, item: { ...ev.item }, started: null, ended: null, ran: false });
    return true;
  }
  if (ev.type === 'response.output_item.done' && CALL_ITEMS.has(ev.item?.type)) {
    const call = find(ev.item.id);
    if (!call) return false;
    call.item = { ...ev.item };
    // A run that failed has no event of its own: its item says so, here.
    // A call the model left unfinished never ran: it has no time to show.
    if (!call.ran) call.started = null;
    else if (call.ended === null) call.ended = now;
    return true;
  }
  const phase = PHASE.exec(ev.type);
  if (phase) {
    const call = find(ev.item_id);
    if (!call) return false;
    const [, , state] = phase;
    // A listing's events come together once it is done: no time to show.
    if (call.type === 'mcp_list_tools') return true;
    if (state === 'in_progress') call.started ??= now;
    else if (state === 'completed' || state === 'failed') call.ended ??= now;
    // The loop took the call (an mcp_call's in_progress comes only then).
    if (state === 'interpreting' || state === 'searching' || call.type === 'mcp_call') call.ran = true;
    call.item.status = state;
    return true;
  }
  const call = find(ev.item_id);
  if (!call) return false;
  switch (ev.type) {
    case 'response.code_interpreter_call_code.delta': call.item.code = (call.item.code || '') + ev.delta; return true;
    case 'response.code_interpreter_call_code.done': call.item.code = ev.code; return true;
    case 'response.mcp_call_arguments.delta': call.item.arguments = (call.item.arguments || '') + ev.delta; return true;
    case 'response.mcp_call_arguments.done': call.item.arguments = ev.arguments; return true;
    default: return false;
  }
}

export function callSeconds(call) {
  if (typeof call.seconds === 'number') return call.seconds;
  if (call.started === null || call.ended === null) return null;
  return Math.max(0, (call.ended - call.started) / 1000);
}

// Milliseconds under a second (a local search takes a few), else seconds.
export function formatCallTime(seconds) {
  if (seconds === null) return '';
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  return `${seconds.toFixed(seconds < 10 ? 2 : 1)} s`;
}

const cut = (text) => (typeof text === 'string' && text.length > MAX_SAVED_CHARS ? `${text.slice(0, MAX_SAVED_CHARS)}…` : text);

// What a saved conversation keeps of a call: its item with long texts cut,
// and its duration (performance.now() readings mean nothing on another visit).
export function savedCall(call) {
  const item = { ...call.item, code: cut(call.item.code), arguments: cut(call.item.arguments), output: cut(call.item.output) };
  if (Array.isArray(item.outputs)) item.outputs = item.outputs.map((o) => (o.type === 'logs' ? { ...o, logs: cut(o.logs) } : { type: o.type }));
  if (Array.isArray(item.results)) item.results = item.results.slice(0, 20).map((r) => ({ ...r, text: cut(r.text), snippet: cut(r.snippet) }));
  return { id: call.id, type: call.type, item, started: null, ended: null, seconds: callSeconds(call) };
}

function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text || '';
  }
}

function block(label, text, cls) {
  return h('div', { class: `call-part ${cls}` }, h('div', { class: 'call-label small muted', text: label }), h('pre', { class: 'call-text', text }));
}

function sourceList(label, urls) {
  return h('div', { class: 'call-part call-sources' }, h('div', { class: 'call-label small muted', text: label }),
    h('ol', { class: 'call-links' }, urls.map((r) => h('li', {},
      h('a', { href: r.url, target: '_blank', rel: 'noopener noreferrer', text: r.title || r.url }),
      r.snippet ? h('span', { class: 'small muted', text: ` — ${r.snippet}` }) : null))));
}

// An mcp_call's error as a person reads it: the protocol or HTTP error's
// message, or the text the tool's execution error came with.
function mcpError(err) {
  if (typeof err === 'string') return err;
  if (err.message) return err.message;
  const texts = Array.isArray(err.content) ? err.content.filter((c) => typeof c?.text === 'string').map((c) => c.text) : [];
  return texts.length ? texts.join('\n') : JSON.stringify(err);
}

// The kind, the subject and the parts (arguments, then result) of a call.
function describe(call) {
  const it = call.item;
  switch (call.type) {
    case 'code_interpreter_call': {
      const logs = (it.outputs || []).filter((o) => o.type === 'logs').map((o) => o.logs).join('');
      const images = (it.outputs || []).filter((o) => o.type === 'image').length;
      return {
        kind: 'code_interpreter', subject: '',
        parts: [block('Code', it.code || '', 'call-code'),
          it.outputs ? block('Logs', logs + (images ? `\n[${images} image${images === 1 ? '' : 's'}]` : '') || '(no output)', 'call-logs') : null],
      };
    }
    case 'web_search_call': {
      const query = it.action?.query || '';
      const results = it.results || (it.action?.sources || []).map((s) => ({ url: s.url }));
      return {
        kind: 'web_search', subject: query,
        parts: [block('Query', query, 'call-query'), results.length ? sourceList('Sources', results) : null],
      };
    }
    case 'file_search_call': {
      const queries = (it.queries || []).join('\n');
      const results = it.results || [];
      return {
        kind: 'file_search', subject: (it.queries || []).join(' · '),
        parts: [block('Query', queries, 'call-query'),
          results.length ? h('div', { class: 'call-part call-results' }, h('div', { class: 'call-label small muted', text: 'Results' }),
            h('ol', { class: 'call-links' }, results.map((r) => h('li', {},
              h('strong', { text: r.filename || r.file_id }), h('span', { class: 'small muted', text: ` score ${Number(r.score).toFixed(3)}` }),
              h('pre', { class: 'call-text', text: r.text || '' }))))) : null],
      };
    }
    case 'mcp_call': {
      const result = it.error ? block('Error', mcpError(it.error), 'call-error')
        : (it.output !== null && it.output !== undefined ? block('Output', it.output, 'call-output') : null);
      return {
        kind: 'mcp', subject: `${it.server_label} · ${it.name}`,
        parts: [block('Arguments', prettyJson(it.arguments), 'call-args'), result],
      };
    }
    default: { // mcp_list_tools
      const names = (it.tools || []).map((t) => t.name);
      return {
        kind: 'mcp', subject: `${it.server_label} · list tools`,
        parts: [it.error ? block('Error', it.error, 'call-error') : block('Tools', names.join('\n') || '(none)', 'call-output')],
      };
    }
  }
}

function statusOf(call) {
  return call.type === 'mcp_list_tools' ? (call.item.error ? 'failed' : 'completed') : (call.item.status || 'in_progress');
}

// One call's view; update() redraws it, keeping whether the reader folded it.
export function callView(call) {
  const kind = h('span', { class: 'call-kind' });
  const subject = h('span', { class: 'call-subject' });
  const status = h('span', { class: 'call-status badge' });
  const time = h('span', { class: 'call-time small muted' });
  const body = h('div', { class: 'call-body' });
  const el = h('details', { class: 'hosted-call', open: true, dataset: { callId: call.id, type: call.type } },
    h('summary', {}, kind, subject, status, time), body);
  const update = () => {
    const d = describe(call);
    const state = statusOf(call);
    el.dataset.kind = d.kind;
    el.dataset.status = state;
    kind.textContent = d.kind;
    subject.textContent = d.subject ? ` ${d.subject}` : '';
    status.textContent = state;
    status.className = `call-status badge state-${state}`;
    const seconds = callSeconds(call);
    time.textContent = formatCallTime(seconds);
    replace(body, d.parts);
  };
  update();
  return { el, call, update };
}

// The tool switches of the chat's settings: one per kind the server
// reports; one that is off is shown off, disabled, with why as its tooltip.
// `choice` (kept by the page) holds what is switched on.
function toolSwitches(states, choice) {
  const rows = [];
  for (const state of states) {
    if (!HOSTED_KINDS.includes(state.type)) continue;
    const id = `chat-tool-${state.type}`;
    const why = state.enabled ? '' : `${state.reason} (setting ${state.setting})`;
    const box = h('input', { id, type: 'checkbox', name: state.type, disabled: !state.enabled, checked: Boolean(state.enabled && choice[state.type]) });
    const label = h('label', { for: id, title: why || null }, box, ` ${LABELS[state.type]}`);
    const extra = state.enabled ? switchDetails(state, choice) : null;
    box.addEventListener('change', () => {
      choice[state.type] = box.checked ? (choice[state.type] || defaultChoice(state)) : false;
      if (box.checked && extra) extra.fill();
      if (extra) extra.el.hidden = !box.checked;
    });
    if (extra) {
      extra.el.hidden = !box.checked;
      if (box.checked) extra.fill();
    }
    rows.push(h('div', { class: `tool-switch${state.enabled ? '' : ' off'}`, dataset: { tool: state.type } }, label,
      state.enabled ? null : h('span', { class: 'small muted tool-why', text: `off: set ${state.setting}` }), extra?.el));
  }
  return rows;
}

function defaultChoice(state) {
  if (state.type === 'mcp') return { url: state.server_urls?.[0] || '', label: '' };
  if (state.type === 'file_search') return { stores: [] };
  return true;
}

// The server an mcp tool names, and the vector stores a file_search searches.
function switchDetails(state, choice) {
  if (state.type === 'mcp') {
    const list = h('datalist', { id: 'chat-mcp-urls' }, (state.server_urls || []).map((u) => h('option', { value: u })));
    const url = h('input', { id: 'chat-mcp-url', type: 'url', list: 'chat-mcp-urls', placeholder: 'https://…/mcp', 'aria-label': 'MCP server URL' });
    url.addEventListener('input', () => { if (choice.mcp) choice.mcp.url = url.value.trim(); });
    return { el: h('div', { class: 'tool-extra' }, url, list), fill: () => { url.value = choice.mcp?.url || ''; } };
  }
  if (state.type === 'file_search') {
    const known = h('datalist', { id: 'chat-vector-store-list' });
    const note = h('p', { class: 'small muted store-note' });
    const stores = h('input', {
      id: 'chat-vector-stores', type: 'text', list: 'chat-vector-store-list', placeholder: 'vs_… (comma-separated)', 'aria-label': 'Vector store ids',
    });
    stores.addEventListener('input', () => {
      if (choice.file_search) choice.file_search.stores = stores.value.split(',').map((s) => s.trim()).filter(Boolean);
    });
    const fill = () => {
      stores.value = (choice.file_search?.stores || []).join(', ');
      // The stores this sign-in may search, to pick from (each key sees its own).
      getJson('v1/vector_stores?limit=100').then((body) => {
        replace(known, body.data.map((vs) => h('option', { value: vs.id, label: vs.name ? `${vs.name} (${vs.id})` : vs.id })));
        note.textContent = body.data.length ? '' : 'No vector stores yet: make one through /v1/vector_stores.';
      }, (err) => { note.textContent = `The vector stores cannot be listed: ${err.message}`; });
    };
    return { el: h('div', { class: 'tool-extra' }, stores, known, note), fill };
  }
  return null;
}

// Why the switched-on tools cannot be sent yet (null: they can).
export function toolProblem(choice) {
  if (choice.mcp && !choice.mcp.url) return 'Give the MCP server’s URL, or switch the MCP tool off.';
  if (choice.file_search && !choice.file_search.stores.length) return 'Name a vector store to search, or switch file search off.';
  return null;
}

// The settings' "Hosted tools" box. `state` (kept by the page across
// visits) holds `tools` (what is switched on) and `requireTool` (send
// tool_choice required). Only what this server runs is offered; what it
// does not is shown off, with why.
export function toolSettings(state) {
  const rows = h('div', { class: 'tool-switches' }, h('p', { class: 'small muted', text: 'Asking the server which tools it runs…' }));
  const require = h('input', { id: 'chat-require-tool', type: 'checkbox', checked: state.requireTool });
  require.addEventListener('change', () => { state.requireTool = require.checked; });
  getJson('api/hosted-tools').then((body) => {
    for (const tool of body.data) if (!tool.enabled) delete state.tools[tool.type];
    replace(rows, toolSwitches(body.data, state.tools));
  }, (err) => {
    replace(rows, h('p', { class: 'small muted', text: `Hosted tools cannot be offered: ${err.message}` }));
  });
  return h('fieldset', { class: 'hosted-tools' }, h('legend', { text: 'Hosted tools' }), rows,
    h('label', { class: 'small', for: 'chat-require-tool', title: 'tool_choice: required' }, require, ' Make the model call a tool'));
}

// A turn's calls, in the order the stream reported them; update() adds the
// new ones and redraws the others.
export function callList(turn) {
  const el = h('div', { class: 'hosted-calls', 'aria-label': 'Tool calls' });
  const views = [];
  const update = () => {
    for (const call of (turn.calls || []).slice(views.length)) {
      const view = callView(call);
      views.push(view);
      el.append(view.el);
    }
    for (const view of views) view.update();
    el.hidden = !views.length;
  };
  update();
  return { el, update };
}
