// The fine-tune form's memory estimate (POST /api/jobs/estimate), live: asked
// again a moment after the user stops changing a field, shown as a panel
// above the submit button, and as one line under each setting that decides
// it, saying what that setting costs per GPU.
import { postJson } from './api.js';
import { formatBytes, h, replace } from './dom.js';

const DEBOUNCE_MS = 400;
// Fields whose cost is shown under them.
const COST_FIELDS = ['batch_size', 'max_seq_len', 'lora_r', 'gradient_checkpointing', 'load_in_4bit', 'gpus'];

// The form's values that read without error; required ones left empty
// (train, before a dataset is picked) are left out: the estimate needs no data.
function quietRead(form) {
  const params = {};
  for (const f of form.fields) {
    const r = f.read();
    if (!r.error && !r.omit) params[f.name] = r.value;
  }
  return params;
}

function costLine(field) {
  let el = field.el.querySelector('.field-cost');
  if (!el) {
    el = h('p', { class: 'field-cost small', dataset: { costOf: field.name } });
    field.el.querySelector('.field-help')?.after(el);
  }
  return el;
}

const b = (n) => formatBytes(n);

// What each setting costs, from the estimate and its alternatives.
function costs(body, perDevice) {
  const e = body.estimate;
  const alt = body.alternatives || {};
  const batchCost = `${b(e.activations_bytes + e.logits_bytes)} ${perDevice} for activations and logits (${e.tokens_per_micro_batch} tokens a micro-batch: batch size × max sequence length).`;
  const ckpt = alt.gradient_checkpointing?.estimate;
  const quant = alt.load_in_4bit;
  const out = {
    batch_size: batchCost,
    max_seq_len: batchCost,
    lora_r: `${b(e.adapter_bytes)} ${perDevice} for the adapter with its gradients and optimizer state; it grows with the rank.`,
  };
  if (ckpt) {
    out.gradient_checkpointing = alt.gradient_checkpointing.value
      ? `Activations ${b(e.activations_bytes)} now; ${b(ckpt.activations_bytes)} with it on.`
      : `Activations ${b(e.activations_bytes)} now; ${b(ckpt.activations_bytes)} with it off.`;
  }
  if (quant?.estimate) {
    out.load_in_4bit = quant.value
      ? `Weights ${b(e.weights_bytes)} now; ${b(quant.estimate.weights_bytes)} with a 4-bit base.${quant.note ? ` ${quant.note}.` : ''}`
      : `Weights ${b(e.weights_bytes)} now; ${b(quant.estimate.weights_bytes)} without the 4-bit base.`;
  }
  if (body.world_size > 1) out.gpus = `Each of the ${body.world_size} GPUs holds a whole copy: the estimate is per GPU.`;
  return out;
}

function devicesLine(body) {
  return body.devices.map((d) => {
    const free = d.free_bytes === null ? 'free memory unknown' : `${b(d.free_bytes)} free of ${b(d.total_bytes)}`;
    return `${d.id}: ${free}`;
  }).join(' · ');
}

function renderEstimate(body) {
  const e = body.estimate;
  const perDevice = body.devices.some((d) => d.id !== 'cpu') ? 'per GPU' : 'in RAM';
  const verdict = body.fits === true ? 'ok' : body.fits === false ? 'warning' : 'info';
  const headroom = body.devices[0]?.headroom_bytes;
  return [
    h('h3', { text: 'Memory estimate' }),
    h('p', { class: 'estimate-total' }, h('strong', { text: b(e.total_bytes) }), ` ${perDevice} · ${body.dtype}`),
    h('dl', { class: 'facts estimate-parts' },
      h('dt', { text: 'Weights' }), h('dd', { text: b(e.weights_bytes) }),
      h('dt', { text: 'Adapter, gradients, optimizer' }), h('dd', { text: b(e.adapter_bytes) }),
      h('dt', { text: 'Activations' }), h('dd', { text: b(e.activations_bytes) }),
      h('dt', { text: 'Logits' }), h('dd', { text: b(e.logits_bytes) }),
      h('dt', { text: 'Total' }), h('dd', { text: b(e.total_bytes) })),
    h('p', { class: `notice ${verdict} estimate-fit`, text: `${body.message.charAt(0).toUpperCase()}${body.message.slice(1)}.` }),
    h('p', { class: 'small muted estimate-devices', text: devicesLine(body) }),
    h('p', { class: 'small muted', text: `Needs about ${b(headroom)} more for the runtime${perDevice === 'per GPU' ? ' (CUDA context, allocator)' : ''}; the job logs the peak it measured.` }),
  ];
}

// Attach to a SchemaForm of the finetune kind: returns the panel element.
// ``placed`` turns the form's params into those the job is sent with (a
// node's GPUs when a node is picked): {params} or {error}.
export function attachEstimate(form, placed = (params) => ({ params })) {
  const panel = h('section', { class: 'estimate card-inset', 'aria-live': 'polite', 'aria-label': 'Memory estimate' });
  let timer = null;
  let asked = 0; // only the latest answer is shown

  function clearCosts() {
    for (const el of form.el.querySelectorAll('.field-cost')) el.remove();
  }

  async function ask() {
    const onIt = placed(quietRead(form));
    const params = onIt.params || {};
    if (onIt.error) {
      clearCosts();
      replace(panel, h('p', { class: 'muted small estimate-none', text: `No memory estimate: ${onIt.error}` }));
      return;
    }
    if (!params.model) {
      clearCosts();
      replace(panel, h('p', { class: 'muted small', text: 'Pick a model to see how much memory the fine-tune needs.' }));
      return;
    }
    const mine = ++asked;
    panel.classList.add('stale');
    let body;
    try {
      body = await postJson('api/jobs/estimate', { kind: 'finetune', params });
    } catch (err) {
      if (mine !== asked) return;
      panel.classList.remove('stale');
      clearCosts();
      replace(panel, h('p', { class: 'muted small estimate-none', text: `No memory estimate: ${err.message}` }));
      // Said under the setting it is about too, where the user just changed it.
      const named = form.field(String(err.param || '').replace(/^params\./, '').split(/[.[]/)[0]);
      if (named && err.param?.startsWith('params.')) {
        const line = costLine(named);
        line.classList.add('refused');
        line.textContent = err.message;
      }
      return;
    }
    if (mine !== asked) return;
    panel.classList.remove('stale');
    if (!body.estimate) {
      clearCosts();
      replace(panel, h('p', { class: 'muted small estimate-none', text: `No memory estimate: ${body.reason || body.message}` }));
      return;
    }
    replace(panel, renderEstimate(body));
    for (const el of form.el.querySelectorAll('.field-cost.refused')) el.remove();
    const perDevice = body.devices.some((d) => d.id !== 'cpu') ? 'per GPU' : 'in RAM';
    const lines = costs(body, perDevice);
    for (const name of COST_FIELDS) {
      const f = form.field(name);
      if (!f) continue;
      if (lines[name]) costLine(f).textContent = lines[name];
      else f.el.querySelector('.field-cost')?.remove();
    }
  }

  const later = () => {
    clearTimeout(timer);
    timer = setTimeout(ask, DEBOUNCE_MS);
  };
  form.el.addEventListener('input', later);
  form.el.addEventListener('change', later);
  ask();
  return panel;
}
