// A vLLM worker said and started ahead of the first message. vLLM's start
// takes 30-60 s on a CPU (its import, then its engine core), against a few
// seconds for llama.cpp, so the chat says so while a vLLM model's worker is
// not serving, under the model picker. The job page's "Try it" on vLLM opens
// the chat with `start=1`: the worker then starts at once, while the user
// types, rather than with the first message.
import { modelPath, postJson } from './api.js';
import { errorBox, h, replace } from './dom.js';

export const VLLM_START = 'its start takes 30-60 s on a CPU';

// The note for `model` ({state, engine} from the picker), or '' when none is due.
export function startNote(model, info) {
  if (info?.engine !== 'vllm') return '';
  if (info.state === 'starting') return `The vLLM worker for ${model} is starting (${VLLM_START}); a message sent now is answered once it serves.`;
  if (info.state === 'unloaded') return `The vLLM worker for ${model} starts with the first message (${VLLM_START}).`;
  return '';
}

// The note element and what keeps it current. `wanted` asks for the start
// of that model's worker once the picker lists it; a failed start shows in
// `errorHost`.
export function startNotice(wanted, errorHost) {
  const el = h('p', { class: 'small notice start-note', role: 'status', hidden: true });
  let pending = wanted;
  let asked = null; // the model whose start was asked for: starting, whatever the list said before
  return {
    el,
    // After each refresh of the picker: `model` is the one selected.
    update(model, info, refresh) {
      if (pending && pending === model && info) {
        pending = null;
        if (info.state === 'unloaded') {
          asked = model;
          postJson(`api/models/${modelPath(info.base)}/load`, {})
            .catch((err) => replace(errorHost, errorBox(err, `Could not start ${info.base}`)))
            .finally(refresh);
          refresh();
        }
      }
      const text = startNote(model, asked === model && info?.state === 'unloaded' ? { ...info, state: 'starting' } : info);
      el.hidden = !text;
      el.textContent = text;
    },
  };
}
