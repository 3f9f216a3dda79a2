// Chat playground: pick a model, stream answers through /v1/responses,
// reasoning apart (collapsible), tokens/s and usage per answer, continue
// with previous_response_id, stop to cancel. The conversation survives
// moving to another page and back (not a reload).
import { getJson } from './api.js';
import { errorBox, formatNumber, h, replace } from './dom.js';
import { ChatSession } from './chat-stream.js';

const conversation = { session: new ChatSession(), turns: [], model: '', instructions: '', maxTokens: 512, temperature: '' };

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

function turnView(turn) {
  const reasoningBody = h('div', { class: 'reasoning-text', text: turn.reasoning });
  const reasoning = h('details', { class: 'reasoning', hidden: !turn.reasoning },
    h('summary', { text: turn.status === 'streaming' && !turn.text ? 'Thinking…' : 'Reasoning' }), reasoningBody);
  const text = h('div', { class: 'answer-text', text: turn.text });
  const meta = h('p', { class: 'usage small muted', text: usageLine(turn) });
  const error = h('div');
  if (turn.error) error.append(errorBox(turn.error));
  const answer = h('div', { class: `msg assistant ${turn.status}`, 'aria-busy': String(turn.status === 'streaming') },
    h('div', { class: 'who', text: turn.model }), reasoning, text, error, meta);
  const el = h('div', { class: 'turn' }, h('div', { class: 'msg user' }, h('div', { class: 'who', text: 'You' }), h('div', { text: turn.user })), answer);
  return {
    el,
    update() {
      reasoningBody.textContent = turn.reasoning;
      reasoning.hidden = !turn.reasoning;
      reasoning.querySelector('summary').textContent = turn.status === 'streaming' && !turn.text ? 'Thinking…' : 'Reasoning';
      text.textContent = turn.text;
      meta.textContent = usageLine(turn);
      answer.className = `msg assistant ${turn.status}`;
      answer.setAttribute('aria-busy', String(turn.status === 'streaming'));
      replace(error, turn.error ? errorBox(turn.error) : null);
    },
  };
}

export function mount(root) {
  const c = conversation;
  const modelSel = h('select', { id: 'chat-model', name: 'model' }, h('option', { value: '', text: 'Loading models…' }));
  const instructions = h('textarea', { id: 'chat-instructions', rows: 3, placeholder: 'Optional system instructions', value: c.instructions });
  const maxTokens = h('input', { id: 'chat-max-tokens', type: 'number', min: 1, step: 1, value: c.maxTokens });
  const temperature = h('input', { id: 'chat-temperature', type: 'number', min: 0, max: 2, step: 0.1, placeholder: 'default', value: c.temperature });
  const modeNote = h('p', { class: 'small muted', role: 'status' });
  const transcript = h('div', { class: 'transcript', role: 'log', 'aria-live': 'polite', 'aria-label': 'Conversation' });
  const input = h('textarea', { id: 'chat-input', rows: 3, placeholder: 'Ask something… (Enter sends, Shift+Enter for a new line)', 'aria-label': 'Message' });
  const sendBtn = h('button', { type: 'submit', class: 'primary', text: 'Send' });
  const stopBtn = h('button', { type: 'button', class: 'danger', text: 'Stop', hidden: true });
  const newBtn = h('button', { type: 'button', class: 'secondary', text: 'New chat' });
  const formError = h('div', { class: 'form-error', role: 'alert' });
  const composer = h('form', { class: 'composer', novalidate: true }, input, formError,
    h('div', { class: 'actions' }, newBtn, h('span', { class: 'spacer' }), stopBtn, sendBtn));

  const settings = h('details', { class: 'card chat-settings', open: true },
    h('summary', {}, h('h2', { text: 'Settings' })),
    h('div', { class: 'field' }, h('label', { for: 'chat-model', text: 'Model' }), modelSel),
    h('div', { class: 'field' }, h('label', { for: 'chat-instructions', text: 'Instructions' }), instructions),
    h('div', { class: 'field-pair' },
      h('div', { class: 'field' }, h('label', { for: 'chat-max-tokens', text: 'Max tokens' }), maxTokens),
      h('div', { class: 'field' }, h('label', { for: 'chat-temperature', text: 'Temperature' }), temperature)),
    modeNote);
  root.append(
    h('div', { class: 'page-head' }, h('h1', { text: 'Chat' }),
      h('p', { class: 'muted', text: 'Talk to a model through the Responses API. Each answer continues the previous one.' })),
    h('div', { class: 'chat-layout' }, settings, h('section', { class: 'card chat-main', 'aria-label': 'Chat' }, transcript, composer)));
  if (window.matchMedia('(max-width: 760px)').matches) settings.open = false;

  let controller = null;
  const views = [];

  function showEmpty() {
    if (!c.turns.length) replace(transcript, h('p', { class: 'empty', text: 'No messages yet. Pick a model and say something.' }));
  }
  function addView(turn) {
    if (!views.length) replace(transcript);
    const view = turnView(turn);
    views.push(view);
    transcript.append(view.el);
    return view;
  }
  for (const t of c.turns) addView(t);
  showEmpty();
  function describeMode() {
    modeNote.textContent = c.session.mode === 'chat'
      ? 'This server has no /v1/responses: using /v1/chat/completions, with the history kept in this page.'
      : c.session.previousId ? `Continuing ${c.session.previousId}.` : '';
  }
  describeMode();

  function setStreaming(on) {
    stopBtn.hidden = !on;
    sendBtn.disabled = on;
    modelSel.disabled = on;
  }

  getJson('api/models').then((body) => {
    const usable = body.data.filter((m) => m.usable);
    if (!usable.length) {
      replace(modelSel, h('option', { value: '', text: 'No usable model' }));
      return;
    }
    replace(modelSel, usable.map((m) => h('option', { value: m.id, text: `${m.id} — ${m.state === 'ready' ? 'loaded' : m.state === 'unloaded' ? 'loads on first use' : m.state}` })));
    const ready = usable.find((m) => m.state === 'ready');
    modelSel.value = usable.some((m) => m.id === c.model) ? c.model : (ready || usable[0]).id;
    c.model = modelSel.value;
  }).catch((err) => {
    replace(modelSel, h('option', { value: '', text: 'Could not list models' }));
    replace(formError, errorBox(err, 'Could not list models'));
  });

  modelSel.addEventListener('change', () => { c.model = modelSel.value; });
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
    controller?.abort();
    c.session.reset();
    c.turns = [];
    views.length = 0;
    showEmpty();
    describeMode();
    input.focus();
  });
  stopBtn.addEventListener('click', () => controller?.abort());

  function readSettings() {
    const max = maxTokens.value.trim() === '' ? null : Number(maxTokens.value);
    if (max !== null && !(Number.isInteger(max) && max >= 1)) return { error: 'Max output tokens must be a whole number ≥ 1.' };
    const temp = temperature.value.trim() === '' ? null : Number(temperature.value);
    if (temp !== null && !(temp >= 0 && temp <= 2)) return { error: 'Temperature must be within 0 and 2.' };
    if (!modelSel.value) return { error: 'Pick a model first.' };
    return { model: modelSel.value, maxTokens: max, temperature: temp, instructions: instructions.value.trim() };
  }

  composer.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    replace(formError);
    const text = input.value.trim();
    if (!text || controller) return;
    const s = readSettings();
    if (s.error) { formError.textContent = s.error; return; }
    const turn = { user: text, model: s.model, reasoning: '', text: '', status: 'streaming', usage: null, error: null, tps: null, seconds: null };
    c.turns.push(turn);
    const view = addView(turn);
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
      firstToken ??= performance.now();
      frame ||= requestAnimationFrame(render);
    };
    try {
      const done = await c.session.turn({ ...s, text, signal: controller.signal }, {
        onText: (d) => { turn.text += d; delta(); },
        onReasoning: (d) => { turn.reasoning += d; delta(); },
        onFallback: describeMode,
      });
      const end = performance.now();
      turn.status = done.status === 'incomplete' ? 'incomplete' : 'completed';
      turn.usage = done.usage;
      turn.seconds = (end - started) / 1000;
      const genSeconds = firstToken ? (end - firstToken) / 1000 : 0;
      if (done.usage?.output_tokens > 1 && genSeconds > 0) turn.tps = (done.usage.output_tokens - 1) / genSeconds;
    } catch (err) {
      if (err.name === 'AbortError') turn.status = 'stopped';
      else { turn.status = 'failed'; turn.error = err; }
      turn.seconds = (performance.now() - started) / 1000;
    } finally {
      cancelAnimationFrame(frame);
      controller = null;
      setStreaming(false);
      view.update();
      describeMode();
      follow();
      input.focus();
    }
  });

  input.focus();
  return () => controller?.abort();
}
