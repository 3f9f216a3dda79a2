// The job kinds and their params schema (GET /api/jobs/schema), fetched once per page load.
import { getJson } from './api.js';

let cached = null;

export function jobKinds() {
  cached ??= getJson('api/jobs/schema').then((body) => body.data).catch((err) => { cached = null; throw err; });
  return cached;
}

// Help text for fields whose names alone say too little.
export const FIELD_HINTS = {
  input: 'A file in the datasets directory (uploaded above, or already there).',
  format: 'auto detects alpaca, ShareGPT, messages or text from the rows.',
  eval_ratio: 'Share of rows held out for evaluation.',
  output_name: 'Left empty, a name is made from the input.',
  model: 'A model id from the library, or a GGUF file in the models directory.',
  type: 'Target quantization type.',
  repo_id: 'owner/name on the Hugging Face Hub.',
  quant: 'A GGUF quantization such as Q4_K_M; picks the matching file.',
  patterns: 'File globs to fetch, one per line (instead of quant).',
  mmproj: 'Also fetch the vision projector, if the repo has one.',
  fallback_smaller: 'If it does not fit on disk, take the largest smaller variant that does.',
  steps: 'How many steps to run.',
  step_seconds: 'Seconds per step.',
};

export const PRIORITY_FIELD = {
  priority: { type: 'integer', minimum: -1000, maximum: 1000, default: 0, description: 'Higher runs first.' },
};
