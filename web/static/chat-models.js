// The chat's model picker: the library's usable models (and each LoRA
// adapter that fits one, as <base>:<adapter>) with their state, refreshed so
// what it says ("loads on first use") stays true; and what a turn shows
// while its model loads (a first use loads it: seconds of nothing otherwise).
import { getJson } from './api.js';
import { errorBox, h, replace } from './dom.js';
import { poll } from './poll.js';
import { VLLM_START } from './chat-start.js';

// What the model picker says about each model's state.
export function modelStateText(m) {
  switch (m.state) {
    case 'ready': return 'loaded';
    case 'starting': return 'loading…';
    case 'unloaded': return 'loads on first use';
    case 'draining': case 'stopping': return 'unloading';
    case 'crashed': return 'restarting after a crash';
    default: return m.state;
  }
}

// The engine a model is served by, as its project spells it (/api/models
// says "vllm" or "llama.cpp").
export function engineName(m) {
  return { vllm: 'vLLM', 'llama.cpp': 'llama.cpp' }[m.engine] || m.engine || '';
}

// A turn's line while it waits for `model` ({state, progress} from the list):
// {text, progress} while the model is not serving yet, else null.
export function loadingState(model, info) {
  if (!info) return null;
  switch (info.state) {
    case 'unloaded': case 'starting':
      if (info.engine === 'vllm') return { text: `Starting the vLLM worker for ${model} (${VLLM_START})…`, progress: info.progress };
      return { text: `Loading the model ${model}…`, progress: info.progress };
    case 'crashed': return { text: `${model} crashed and is restarting…`, progress: null };
    case 'draining': case 'stopping': return { text: `Waiting for ${model} (it is unloading)…`, progress: null };
    default: return null;
  }
}

const FAST_MS = 500; // while a turn waits for its model
const LOADING_MS = 1000; // while some model loads
const IDLE_MS = 5000;

// Fills `select` from GET api/models and keeps it current. `wanted` is a
// model asked for in the URL (#/chat?model=…): it may just have been written
// (a quantize result), so it is picked once the library lists it.
// `current()` is the conversation's model; `onPick(id)` hears the choice;
// `onList()` runs after each refresh; `onError(box)` shows a failed first list.
export function modelPicker(select, { wanted = null, current, onPick, onList, onError }) {
  const infos = new Map(); // picker id -> { state, progress, vision, visionError, engine, base }
  let pending = wanted;
  let firstList = true;
  let hurry = false;
  const poller = poll(async () => {
    let body;
    try {
      body = await getJson('api/models');
    } catch (err) {
      if (firstList) {
        replace(select, h('option', { value: '', text: 'Could not list models' }));
        onError(errorBox(err, 'Could not list models'));
      }
      return;
    }
    const usable = body.data.filter((m) => m.usable)
      .flatMap((m) => [{ ...m, base: m.id }, ...(m.adapters || []).map((a) => ({ ...m, id: a.model, base: m.id }))]);
    if (!usable.length) {
      replace(select, h('option', { value: '', text: 'No usable model' }));
      return;
    }
    const keep = firstList ? null : select.value;
    infos.clear();
    for (const m of usable) {
      infos.set(m.id, {
        state: m.state, progress: m.load?.progress ?? null, vision: Boolean(m.vision), visionError: m.vision_error || '',
        engine: m.engine, base: m.base,
      });
    }
    replace(select, usable.map((m) => h('option', { value: m.id, dataset: { state: m.state }, text: `${m.id} — ${[engineName(m), modelStateText(m)].filter(Boolean).join(' · ')}` })));
    const has = (id) => id && infos.has(id);
    const ready = usable.find((m) => m.state === 'ready');
    if (pending && has(pending)) { select.value = pending; pending = null; } else {
      select.value = has(keep) ? keep : has(current()) ? current() : (ready || usable[0]).id;
    }
    onPick(select.value);
    firstList = false;
    onList();
  }, () => {
    if (hurry) return FAST_MS;
    return select.querySelector('option[data-state=starting]') ? LOADING_MS : IDLE_MS;
  });
  select.addEventListener('change', () => { pending = null; onPick(select.value); });
  return {
    info: (id) => infos.get(id) || null,
    now: () => poller.now(),
    // Poll fast while a turn waits for its model to load.
    hurry(on) { hurry = on; if (on) poller.now(); },
    stop: () => poller.stop(),
  };
}
