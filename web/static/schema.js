// The job kinds and their params schema (GET /api/jobs/schema), fetched once
// per page load, with the labels and help text the forms show for them.
import { getJson } from './api.js';

let cached = null;

export function jobKinds() {
  cached ??= getJson('api/jobs/schema').then((body) => body.data).catch((err) => { cached = null; throw err; });
  return cached;
}

// Kinds only the test suite uses. They stay out of the form's kind picker
// unless the schema marks them visible (`hidden: false` / `test: false`) or
// the page is opened with ?testkinds=1.
const TEST_KINDS = new Set(['sleep']);

export function isTestKind(k) {
  if (k.hidden === true || k.test === true) return true;
  if (k.hidden === false || k.test === false) return false;
  return TEST_KINDS.has(k.kind);
}

// What a user reads instead of the raw field name.
export const FIELD_LABELS = {
  input: 'Dataset file',
  format: 'Row format',
  eval_ratio: 'Evaluation share',
  seed: 'Random seed',
  output_name: 'Output name',
  dedupe: 'Drop duplicate rows',
  model: 'Model',
  max_bad_rows: 'Bad rows allowed',
  overwrite: 'Overwrite existing output',
  type: 'Quantization type',
  allow_requantize: 'Allow re-quantizing',
  nthread: 'Threads',
  repo_id: 'Hub repository',
  revision: 'Revision',
  patterns: 'File patterns',
  quant: 'Quantization',
  fallback_smaller: 'Fall back to a smaller file',
  mmproj: 'Projector (mmproj)',
  train: 'Training data',
  eval: 'Evaluation data',
  lora_r: 'LoRA rank',
  lora_alpha: 'LoRA alpha',
  lora_dropout: 'LoRA dropout',
  target_modules: 'Target modules',
  learning_rate: 'Learning rate',
  lr_scheduler: 'LR schedule',
  warmup_ratio: 'Warm-up share',
  weight_decay: 'Weight decay',
  max_grad_norm: 'Gradient clipping',
  epochs: 'Epochs',
  max_steps: 'Max steps',
  batch_size: 'Batch size',
  gradient_accumulation_steps: 'Gradient accumulation',
  gradient_checkpointing: 'Gradient checkpointing',
  load_in_4bit: '4-bit base (QLoRA)',
  max_seq_len: 'Max sequence length',
  save_steps: 'Checkpoint every',
  save_total_limit: 'Checkpoints kept',
  eval_steps: 'Evaluate every',
  dtype: 'Precision',
  cpu_threads: 'CPU threads',
  merge: 'Merge the adapter',
  export_adapter: 'Export the adapter (GGUF LoRA)',
  base: 'Base model',
  gpus: 'GPUs',
  gpu_ids: 'Which GPUs',
  export: 'Export options',
  outtype: 'Output type',
  quantize: 'Quantize to',
  keep_unquantized: 'Keep the unquantized file',
  priority: 'Priority',
  steps: 'Steps',
  step_seconds: 'Seconds per step',
  events_per_step: 'Events per step',
  crash: 'Crash mode',
  crash_at_step: 'Crash at step',
  ignore_term: 'Ignore SIGTERM',
  use_device: 'Use the GPU lease',
  tag: 'Tag',
  // Load options (Models page)
  n_ctx: 'Context length',
  cache_type: 'KV cache type',
  n_gpu_layers: 'GPU layers',
  keep_alive: 'Keep loaded for',
};

// Help per field; `kind:field` entries win over plain `field` ones.
export const FIELD_HINTS = {
  input: 'A file in the datasets directory: pick an uploaded one, or upload a file above.',
  format: 'auto detects alpaca, ShareGPT, messages or text from the rows.',
  eval_ratio: 'Share of rows held out for evaluation.',
  seed: 'Makes the split (or training) repeatable.',
  output_name: 'Left empty, a name is made from the input.',
  dedupe: 'Identical rows are kept once.',
  max_bad_rows: 'The job fails when more rows than this cannot be read.',
  overwrite: 'Replace an output of the same name instead of failing.',
  model: 'A model id from the library, or a GGUF file in the models directory.',
  'dataset:model': 'Optional: a library model whose tokenizer counts the tokens in the stats.',
  'quantize:model': 'The GGUF model to quantize: a model id from the library.',
  'finetune:model': 'A Hugging Face model directory (a folder with config.json) in the models directory, or an owner/name repo id. Not a GGUF file.',
  type: 'Target quantization type; Q4_K_M is a good default.',
  allow_requantize: 'Quantize a model that is already quantized (loses quality).',
  nthread: 'CPU threads to use; 0 uses every core.',
  repo_id: 'owner/name on the Hugging Face Hub, e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF.',
  revision: 'Branch, tag or commit.',
  quant: 'A GGUF quantization such as Q4_K_M; picks the matching file.',
  patterns: 'File globs to fetch, one per line (instead of quant).',
  mmproj: 'Also fetch the vision projector, if the repo has one.',
  fallback_smaller: 'If it does not fit on disk, take the largest smaller variant that does.',
  train: 'Chat JSONL in the datasets directory, e.g. the train file of a dataset job.',
  eval: 'Optional chat JSONL for evaluation, e.g. the eval file of a dataset job.',
  'finetune:output_name': 'Folder in the outputs directory; left empty, a name is made from the model.',
  lora_r: 'Rank of the LoRA matrices; higher learns more and uses more memory.',
  lora_alpha: 'Scaling of the LoRA update; often equal to the rank.',
  lora_dropout: 'Dropout on the LoRA layers; 0 turns it off.',
  target_modules: 'Layer names to adapt, one per line; empty uses the usual attention and MLP projections.',
  learning_rate: 'Step size of the optimizer.',
  lr_scheduler: 'How the learning rate changes over the run.',
  warmup_ratio: 'Share of steps spent ramping the learning rate up.',
  weight_decay: 'L2 penalty on the weights.',
  max_grad_norm: 'Gradients are clipped to this norm; 0 turns it off.',
  epochs: 'Passes over the training data.',
  max_steps: 'Stop after this many steps; empty runs the epochs.',
  batch_size: 'Rows per step on the device; activation and logit memory grow with it.',
  gradient_accumulation_steps: 'Steps summed before each optimizer update: a larger effective batch for no more memory.',
  gradient_checkpointing: 'Recomputes each layer in the backward pass: far less activation memory, about a third more compute.',
  load_in_4bit: 'Holds the base in 4 bits (bitsandbytes, CUDA only): about a quarter of its 16-bit memory.',
  max_seq_len: 'Longer rows are cut to this many tokens; activation and logit memory grow with it.',
  save_steps: 'Steps between checkpoints (used by Cancel and save, and Resume).',
  save_total_limit: 'Older checkpoints are deleted.',
  eval_steps: 'Steps between evaluations; empty evaluates at the end only.',
  dtype: 'Weights precision; auto picks bfloat16 where the GPU has it.',
  cpu_threads: 'Threads when training on the CPU; 0 uses torch’s default.',
  merge: 'Also write the model with the adapter merged in.',
  export_adapter: 'Also write the adapter as a GGUF LoRA file in the models directory: served on its base as base:adapter, no merge needed.',
  base: 'For an adapter directory: the base model\'s Hugging Face directory, if the adapter does not record one.',
  'export:model': 'A Hugging Face model directory (with config.json), such as the merged output of a fine-tune, or a LoRA adapter directory (with adapter_config.json), which becomes a GGUF LoRA adapter. Not a GGUF file.',
  gpus: 'How many GPUs the job takes; the least used come first.',
  'finetune:gpus': 'How many GPUs to train on; each holds a whole copy of the model (data-parallel), so the memory per GPU stays the same.',
  gpu_ids: 'Exactly these devices, one per line (cuda:1, or 1; cpu on a machine without one); overrides GPUs.',
  export: 'JSON options to convert the merged model to GGUF, e.g. {"quantize": "Q4_K_M"}; empty skips it.',
  outtype: 'Precision of the converted GGUF file.',
  quantize: 'Also quantize the converted file; empty keeps it as converted.',
  keep_unquantized: 'Keep the converted file next to the quantized one.',
  steps: 'How many steps to run.',
  step_seconds: 'Seconds per step.',
  events_per_step: 'Progress events sent per step.',
  crash: 'How the test job fails on purpose.',
  crash_at_step: 'Step at which it fails.',
  ignore_term: 'Keep running on SIGTERM (tests the kill path).',
  use_device: 'Take the GPU lease while running.',
  tag: 'Free text to find the job by.',
};

// The text of the empty choice of an optional enum, instead of "(none)".
export const NONE_LABELS = {
  quantize: 'keep as converted',
  'export:quantize': 'keep as converted',
  cache_type: 'automatic',
};

export const PRIORITY_FIELD = {
  priority: { type: 'integer', minimum: -1000, maximum: 1000, default: 0, description: 'Jobs with a higher priority run first.' },
};

// Per-field lookups for one kind, for SchemaForm.
export function fieldText(kind) {
  const pick = (map) => new Proxy({}, { get: (_, name) => map[`${kind}:${String(name)}`] ?? map[name] });
  return { hints: pick(FIELD_HINTS), labels: pick(FIELD_LABELS), noneLabels: pick(NONE_LABELS) };
}
