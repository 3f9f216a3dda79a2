// Chat playground: pick a model, stream answers through /v1/responses,
// reasoning apart (collapsible), tokens/s and usage per answer, continue
// with previous_response_id, stop to cancel. Answers render as Markdown
// (built as DOM nodes, never as HTML). Conversations are kept in this
// browser (localStorage) to open, continue, rename and delete later; the
// model can change between turns of one conversation. Images attach by the
// file picker, drag-and-drop or paste, for models whose projector loaded
// (``vision`` in /api/models); they are sent inline as data: URLs. Until
// its first token, a turn to a model that is not loaded says it loads, with
// the load's progress (the picker and that line: chat-models.js); a vLLM
// model's slow start is said under the picker (chat-start.js). The hosted
// tools the server runs are switched on in the settings and each call they
// make shows in the answer (chat-calls.js).
import { send } from './api.js';
import { errorBox, formatNumber, h, progressBar, replace } from './dom.js';
import { loadingState, modelPicker } from './chat-models.js';
import { startNotice } from './chat-start.js';
import { ChatSession } from './chat-stream.js';
import { callList, followCall, requestTools, toolProblem, toolSettings } from './chat-calls.js';
import { busyBox, isDeviceBusy, positionText, waitForDevice } from './chat-wait.js';
import {
  getConversation, listConversations, newConversationId, removeConversation, renameConversation, saveConversation, titleFrom,
} from './chat-store.js';
import { renderMarkdown } from './markdown.js';

const conversation = {
  session: new ChatSession(), turns: [], model: '', instructions: '', maxTokens: 512, temperature: '', id: null, title: '',
  tools: {}, requireTool: false, // hosted tools switched on (chat-calls.js requestTools), tool_choice required
};

// The server's bounds (worker/protocol.py): refused here first, with the reason.
// What the engine decodes: WebP is not among them.
export const IMAGE_TYPES = ['image/png', 'image/jpeg', 'image/gif'];
const MAX_IMAGES = 8;
const MAX_IMAGE_BYTES = 4 * 1024 * 1024;

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function usageLine(turn) {
  const u = turn.usage;
  const parts = [];
  if (u) {
    parts.push(`${formatNumber(u.input_tokens)} in`, `${formatNumber(u.output_tokens)} out`);
    const reasoning = u.output_tokens_details?.reasoning_tokens;
    if (reasoning) parts.push(`${formatNumber(reasoning)} reasoning`);
  }
  if (turn.tps) parts.push(`${formatNumber(turn.tps, 1)} tok/s`);
  if (turn.seconds) parts.push(`${turn.seconds.toFixed(1)} s`);
  if (turn.status === 'incomplete') parts.push('cut at the token limit');
  if (turn.status === 'stopped') parts.push('stopped');
  return parts.join(' · ');
}

// A refused turn's notice: a busy device offers to wait (see chat-wait.js).
function turnError(turn, actions) {
  if (!turn.error) return null;
  if (isDeviceBusy(turn.error) && actions) {
    return busyBox(turn.error, turn.waiting, () => actions.wait(turn), () => actions.cancelWait(turn));
  }
  return errorBox(turn.error);
}

// While the turn waits for its model to load: what is happening, and how far.
function loadingLine(turn) {
  if (!turn.loading) return [];
  const { text, progress } = turn.loading;
  return [text, typeof progress === 'number' ? [' ', h('span', { class: 'pct', text: `${Math.round(progress * 100)}%` }), progressBar(progress, `loading ${turn.model}`)] : null];
}

function turnView(turn, actions) {
  const loading = h('p', { class: 'turn-loading small muted', role: 'status', hidden: !turn.loading }, loadingLine(turn));
  const reasoningBody = h('div', { class: 'reasoning-text', text: turn.reasoning });
  const reasoning = h('details', { class: 'reasoning', hidden: !turn.reasoning },
    h('summary', { text: turn.status === 'streaming' && !turn.text ? 'Thinking…' : 'Reasoning' }), reasoningBody);
  const calls = callList(turn);
  const text = h('div', { class: 'answer-text markdown' });
  text.append(renderMarkdown(turn.text));
  let shown = turn.text;
  const meta = h('p', { class: 'usage small muted', text: usageLine(turn) });
  const error = h('div');
  error.append(turnError(turn, actions) ?? '');
  const answer = h('div', { class: `msg assistant ${turn.status}`, 'aria-busy': String(turn.status === 'streaming') },
    h('div', { class: 'who', text: turn.model }), loading, reasoning, calls.el, text, error, meta);
  // Saved conversations keep only a count of their images (localStorage is small).
  const pics = (turn.images || []).map((url) => h('img', { class: 'chat-image', src: url, alt: 'attached image' }));
  const missing = (turn.imageCount || 0) - pics.length;
  const images = pics.length || missing > 0
    ? h('div', { class: 'chat-images' }, ...pics,
      missing > 0 ? h('span', { class: 'small muted', text: `${missing} image${missing === 1 ? '' : 's'} (not kept in this browser)` }) : null)
    : null;
  const el = h('div', { class: 'turn' }, h('div', { class: 'msg user' }, h('div', { class: 'who', text: 'You' }), images, h('div', { class: 'user-text', text: turn.user })), answer);
  return {
    el,
    turn,
    update() {
      loading.hidden = !turn.loading;
      replace(loading, loadingLine(turn));
      reasoningBody.textContent = turn.reasoning;
      reasoning.hidden = !turn.reasoning;
      reasoning.querySelector('summary').textContent = turn.status === 'streaming' && !turn.text ? 'Thinking…' : 'Reasoning';
      if (turn.callsChanged) { calls.update(); turn.callsChanged = false; }
      if (turn.text !== shown) { replace(text, renderMarkdown(turn.text)); shown = turn.text; }
      meta.textContent = usageLine(turn);
      answer.className = `msg assistant ${turn.status}`;
      answer.setAttribute('aria-busy', String(turn.status === 'streaming'));
      replace(error, turnError(turn, actions));
    },
  };
}

export function mount(root, _params, query) {
  const c = conversation;
  const modelSel = h('select', { id: 'chat-model', name: 'model' }, h('option', { value: '', text: 'Loading models…' }));
  const instructions = h('textarea', { id: 'chat-instructions', rows: 3, placeholder: 'Optional system instructions', value: c.instructions });
  const maxTokens = h('input', { id: 'chat-max-tokens', type: 'number', min: 1, step: 1, value: c.maxTokens });
  const temperature = h('input', { id: 'chat-temperature', type: 'number', min: 0, max: 2, step: 0.1, placeholder: 'default', value: c.temperature });
  const modeNote = h('p', { class: 'small muted mode-note', role: 'status' });
  const transcript = h('div', { class: 'transcript', role: 'log', 'aria-live': 'polite', 'aria-label': 'Conversation' });
  const input = h('textarea', { id: 'chat-input', rows: 3, placeholder: 'Ask something… (Enter sends, Shift+Enter for a new line)', 'aria-label': 'Message' });
  const sendBtn = h('button', { type: 'submit', class: 'primary', text: 'Send' });
  const stopBtn = h('button', { type: 'button', class: 'danger', text: 'Stop', hidden: true });
  const newBtn = h('button', { type: 'button', class: 'secondary', text: 'New chat' });
  const formError = h('div', { class: 'form-error', role: 'alert' });
  // Try it on vLLM asks for its worker's start (start=1), said until it serves.
  const start = startNotice(query?.get('start') === '1' ? query.get('model') : null, formError);
  const picker = h('input', { id: 'chat-image-file', type: 'file', accept: IMAGE_TYPES.join(','), multiple: true, hidden: true });
  const attachBtn = h('button', { type: 'button', class: 'secondary', text: 'Attach image', 'aria-controls': 'chat-image-file' });
  const thumbs = h('div', { class: 'chat-images attached', 'aria-label': 'Images to send' });
  const composer = h('form', { class: 'composer', novalidate: true }, thumbs, input, formError,
    h('div', { class: 'actions' }, newBtn, attachBtn, picker, h('span', { class: 'spacer' }), stopBtn, sendBtn));
  let attached = []; // data: URLs for the next turn
  const convList = h('ul', { class: 'plain conversations', 'aria-label': 'Saved conversations' });

  const settings = h('details', { class: 'card chat-settings', open: true },
    h('summary', {}, h('h2', { text: 'Settings' })),
    h('div', { class: 'field' }, h('label', { for: 'chat-instructions', text: 'Instructions' }), instructions),
    h('div', { class: 'field-pair' },
      h('div', { class: 'field' }, h('label', { for: 'chat-max-tokens', text: 'Max tokens' }), maxTokens),
      h('div', { class: 'field' }, h('label', { for: 'chat-temperature', text: 'Temperature' }), temperature)),
    toolSettings(c), modeNote);
  const history = h('details', { class: 'card chat-history', open: true },
    h('summary', {}, h('h2', { text: 'Conversations' })), convList);
  root.append(
    h('div', { class: 'page-head' }, h('h1', { text: 'Chat' }),
      h('p', { class: 'muted', text: 'Talk to a model through the Responses API. Each answer continues the previous one.' })),
    h('div', { class: 'chat-layout' }, h('div', { class: 'chat-side' }, settings, history),
      h('section', { class: 'card chat-main', 'aria-label': 'Chat' },
        // The model stays in view on a phone too, where the settings fold away.
        h('div', { class: 'chat-model-bar' }, h('label', { for: 'chat-model', text: 'Model' }), modelSel),
        start.el, transcript, composer)));
  if (window.matchMedia('(max-width: 760px)').matches) { settings.open = false; history.open = false; }

  let controller = null;
  const views = [];

  // Waiting in line for a device a job holds (one wait at a time; leaving the
  // page stops it). When the device frees, the refused turn is sent again.
  let waiting = null;
  const waitActions = {
    async wait(turn) {
      if (waiting || controller) return;
      waiting = new AbortController();
      turn.waiting = 'Waiting in line…';
      refresh(turn);
      try {
        await waitForDevice(turn.model, waiting.signal, (state) => {
          turn.waiting = positionText(state);
          if (state.job) turn.error.job = state.job;
          refresh(turn);
        });
      } catch (err) {
        if (err.name !== 'AbortError') turn.error = err;
        turn.waiting = null;
        refresh(turn);
        return;
      } finally {
        waiting = null;
      }
      resend(turn);
    },
    cancelWait() { waiting?.abort(); },
  };
  function refresh(turn) {
    views.find((v) => v.turn === turn)?.update();
  }
  function resend(turn) {
    const at = c.turns.indexOf(turn);
    if (at < 0) return;
    c.turns.splice(at, 1);
    showTurns();
    if ([...modelSel.options].some((o) => o.value === turn.model)) modelSel.value = turn.model;
    input.value = turn.user;
    attached = [...(turn.images || [])];
    showThumbs();
    composer.requestSubmit();
  }

  function showEmpty() {
    if (!c.turns.length) replace(transcript, h('p', { class: 'empty', text: 'No messages yet. Pick a model and say something.' }));
  }
  function addView(turn) {
    if (!views.length) replace(transcript);
    const view = turnView(turn, waitActions);
    views.push(view);
    transcript.append(view.el);
    return view;
  }
  function showTurns() {
    views.length = 0;
    replace(transcript);
    for (const t of c.turns) addView(t);
    showEmpty();
    transcript.scrollTop = transcript.scrollHeight;
  }
  showTurns();

  function describeMode() {
    if (c.session.mode === 'chat') {
      modeNote.textContent = 'This server has no /v1/responses: using /v1/chat/completions, with the history kept in this page.';
    } else if (c.session.previousId) {
      // The id means nothing to a reader: it stays in the tooltip.
      replace(modeNote, h('span', {
        class: 'response-id', title: `previous_response_id: ${c.session.previousId}`, dataset: { responseId: c.session.previousId },
        text: 'Each message continues this conversation, stored on the server.',
      }));
    } else {
      replace(modeNote);
    }
  }
  describeMode();

  function renderConversations() {
    const list = listConversations();
    if (!list.length) {
      replace(convList, h('li', { class: 'small muted', text: 'No saved conversations yet. They are kept in this browser.' }));
      return;
    }
    replace(convList, list.map((conv) => {
      const open = h('button', {
        type: 'button', class: 'conv-open', 'aria-current': conv.id === c.id ? 'true' : null, title: conv.title,
        onclick: () => openConversation(conv.id),
      }, h('span', { class: 'conv-title', text: conv.title }),
      h('span', { class: 'small muted', text: `${conv.turns.length} turn${conv.turns.length === 1 ? '' : 's'} · ${conv.model}` }));
      const rename = h('button', { type: 'button', class: 'secondary small', text: 'Rename', 'aria-label': `Rename ${conv.title}` });
      const remove = h('button', { type: 'button', class: 'danger small', text: 'Delete', 'aria-label': `Delete ${conv.title}` });
      const li = h('li', { dataset: { conversation: conv.id } }, open, h('div', { class: 'conv-actions' }, rename, remove));
      rename.addEventListener('click', () => {
        const field = h('input', { type: 'text', value: conv.title, 'aria-label': 'New title', class: 'conv-rename' });
        const done = (save) => {
          if (save && field.value.trim()) {
            renameConversation(conv.id, field.value);
            if (conv.id === c.id) c.title = field.value.trim();
          }
          renderConversations();
        };
        field.addEventListener('keydown', (ev) => {
          if (ev.key === 'Enter') { ev.preventDefault(); done(true); }
          if (ev.key === 'Escape') done(false);
        });
        field.addEventListener('blur', () => done(true));
        replace(li, field);
        field.focus();
        field.select();
      });
      remove.addEventListener('click', async () => {
        if (!confirm(`Delete the conversation “${conv.title}”?`)) return;
        removeConversation(conv.id);
        if (conv.id === c.id) startNew();
        renderConversations();
        // The stored responses go too, where the server keeps them.
        for (const id of conv.turns.map((t) => t.responseId).filter(Boolean)) {
          send('DELETE', `v1/responses/${encodeURIComponent(id)}`).catch(() => {});
        }
      });
      return li;
    }));
  }
  renderConversations();

  function startNew() {
    controller?.abort();
    c.session.reset();
    c.turns = [];
    c.id = null;
    c.title = '';
    showTurns();
    describeMode();
  }

  function openConversation(id) {
    const conv = getConversation(id);
    if (!conv || controller) return;
    c.session.reset();
    c.session.previousId = conv.lastResponseId || null;
    c.session.history = conv.history || [];
    c.turns = conv.turns.map((t) => ({ ...t }));
    c.id = conv.id;
    c.title = conv.title;
    if (conv.model && [...modelSel.options].some((o) => o.value === conv.model)) { modelSel.value = conv.model; c.model = conv.model; }
    showTurns();
    describeMode();
    renderConversations();
    input.focus();
  }

  function persist() {
    if (!c.turns.length) return;
    c.id ??= newConversationId();
    c.title ||= titleFrom(c.turns[0].user);
    const last = c.turns[c.turns.length - 1];
    saveConversation({
      id: c.id, title: c.title, model: last.model, lastResponseId: c.session.previousId,
      history: c.session.mode === 'chat' ? c.session.history : undefined,
      turns: c.turns.map(({ images: _images, ...t }) => t),
    });
    renderConversations();
  }

  function setStreaming(on) {
    stopBtn.hidden = !on;
    sendBtn.disabled = on;
    modelSel.disabled = on;
  }

  // The model list, refreshed so a state shown ("loads on first use") stays
  // true; a turn waiting for its model shows how the load goes.
  let waitingTurn = null; // { turn, view } streaming with nothing received yet
  const showLoading = () => {
    if (!waitingTurn) return;
    const { turn, view } = waitingTurn;
    turn.loading = loadingState(turn.model, models.info(turn.model));
    view.update();
  };
  const models = modelPicker(modelSel, {
    wanted: query?.get('model') || null,
    current: () => c.model,
    onPick: (id) => { c.model = id; start.update(id, models.info(id), () => models.now()); },
    onList: () => { showLoading(); start.update(modelSel.value, models.info(modelSel.value), () => models.now()); },
    onError: (box) => replace(formError, box),
  });

  // Why the selected model cannot take images, or null when it can.
  function noVision() {
    const v = models.info(modelSel.value);
    if (!v || v.vision) return null;
    return `${modelSel.value} takes no images: it has no vision projector${v.visionError ? ` (${v.visionError})` : ''}.`;
  }
  function showThumbs() {
    replace(thumbs, attached.map((url, i) => h('span', { class: 'thumb' },
      h('img', { class: 'chat-image', src: url, alt: `image ${i + 1} to send` }),
      h('button', {
        type: 'button', class: 'secondary small', text: '×', 'aria-label': `Remove image ${i + 1}`,
        onclick: () => { attached.splice(i, 1); showThumbs(); },
      }))));
  }
  async function attach(files) {
    replace(formError);
    const why = noVision();
    if (why) { formError.textContent = why; return; }
    for (const file of files) {
      if (!IMAGE_TYPES.includes(file.type)) { formError.textContent = `${file.name || 'That file'} is not a PNG, JPEG or GIF image (the engine decodes no other).`; continue; }
      if (file.size > MAX_IMAGE_BYTES) { formError.textContent = `${file.name || 'The image'} is over 4 MiB.`; continue; }
      if (attached.length >= MAX_IMAGES) { formError.textContent = `At most ${MAX_IMAGES} images per message.`; break; }
      attached.push(await readDataUrl(file));
    }
    showThumbs();
  }
  attachBtn.addEventListener('click', () => picker.click());
  picker.addEventListener('change', () => { attach([...picker.files]); picker.value = ''; });
  composer.addEventListener('dragover', (ev) => { ev.preventDefault(); composer.classList.add('dropping'); });
  composer.addEventListener('dragleave', () => composer.classList.remove('dropping'));
  composer.addEventListener('drop', (ev) => {
    ev.preventDefault();
    composer.classList.remove('dropping');
    attach([...(ev.dataTransfer?.files || [])]);
  });
  input.addEventListener('paste', (ev) => {
    const files = [...(ev.clipboardData?.files || [])].filter((file) => file.type.startsWith('image/'));
    if (files.length) { ev.preventDefault(); attach(files); }
  });
  instructions.addEventListener('input', () => { c.instructions = instructions.value; });
  maxTokens.addEventListener('input', () => { c.maxTokens = maxTokens.value; });
  temperature.addEventListener('input', () => { c.temperature = temperature.value; });

  input.addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      composer.requestSubmit();
    }
  });
  newBtn.addEventListener('click', () => {
    startNew();
    renderConversations();
    input.focus();
  });
  stopBtn.addEventListener('click', () => controller?.abort());

  function readSettings() {
    const max = maxTokens.value.trim() === '' ? null : Number(maxTokens.value);
    if (max !== null && !(Number.isInteger(max) && max >= 1)) return { error: 'Max output tokens must be a whole number ≥ 1.' };
    const temp = temperature.value.trim() === '' ? null : Number(temperature.value);
    if (temp !== null && !(temp >= 0 && temp <= 2)) return { error: 'Temperature must be within 0 and 2.' };
    if (!modelSel.value) return { error: 'Pick a model first.' };
    const toolError = toolProblem(c.tools);
    if (toolError) return { error: toolError };
    const { tools: list, include } = requestTools(c.tools);
    return {
      model: modelSel.value, maxTokens: max, temperature: temp, instructions: instructions.value.trim(),
      tools: list, include, toolChoice: list.length && c.requireTool ? 'required' : null,
    };
  }

  composer.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    replace(formError);
    const text = input.value.trim();
    if (!text || controller) return;
    const s = readSettings();
    if (s.error) { formError.textContent = s.error; return; }
    const images = attached;
    if (images.length && noVision()) { formError.textContent = noVision(); return; }
    attached = [];
    showThumbs();
    const turn = {
      user: text, images, imageCount: images.length, model: s.model, reasoning: '', text: '', status: 'streaming', usage: null, error: null, tps: null, seconds: null, responseId: null, loading: null, calls: [],
    };
    c.turns.push(turn);
    const view = addView(turn);
    // Until the first token: a model that is not loaded yet says so (a first use loads it).
    waitingTurn = { turn, view };
    showLoading();
    models.hurry(true);
    const received = () => {
      if (!waitingTurn) return;
      waitingTurn = null;
      turn.loading = null;
      models.hurry(false);
    };
    input.value = '';
    controller = new AbortController();
    setStreaming(true);
    const started = performance.now();
    let firstToken = null;
    const follow = () => {
      // Keep the newest text in view unless the reader scrolled up.
      if (transcript.scrollHeight - transcript.scrollTop - transcript.clientHeight < 80) transcript.scrollTop = transcript.scrollHeight;
    };
    // Deltas can arrive far faster than the screen refreshes; rendering each
    // one would starve the page (and its Stop button), so draw once a frame.
    let frame = 0;
    const render = () => { frame = 0; view.update(); follow(); };
    const delta = () => {
      received();
      firstToken ??= performance.now();
      frame ||= requestAnimationFrame(render);
    };
    try {
      const done = await c.session.turn({ ...s, text, images, signal: controller.signal }, {
        onStart: (id) => { turn.responseId = id; },
        onText: (d) => { turn.text += d; delta(); },
        onReasoning: (d) => { turn.reasoning += d; delta(); },
        onEvent: (ev) => {
          if (!followCall(turn.calls, ev, performance.now())) return;
          turn.callsChanged = true;
          received();
          frame ||= requestAnimationFrame(render);
        },
        onFallback: describeMode,
      });
      const end = performance.now();
      turn.status = done.status === 'incomplete' ? 'incomplete' : 'completed';
      turn.usage = done.usage;
      turn.responseId = done.id || turn.responseId;
      turn.seconds = (end - started) / 1000;
      const genSeconds = firstToken ? (end - firstToken) / 1000 : 0;
      if (done.usage?.output_tokens > 1 && genSeconds > 0) turn.tps = (done.usage.output_tokens - 1) / genSeconds;
    } catch (err) {
      if (err.name === 'AbortError') turn.status = 'stopped';
      else { turn.status = 'failed'; turn.error = err; }
      turn.seconds = (performance.now() - started) / 1000;
    } finally {
      received();
      cancelAnimationFrame(frame);
      controller = null;
      setStreaming(false);
      view.update();
      describeMode();
      follow();
      persist();
      models.now(); // the model just used is loaded now
      input.focus();
    }
  });

  input.focus();
  return () => { controller?.abort(); waiting?.abort(); models.stop(); };
}
