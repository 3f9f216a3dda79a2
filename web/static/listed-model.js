// A download's "Chat with this model", offered only once /v1/models lists
// the id the job reported, for the file it downloaded. A finished download
// is not yet a served model: the library lists it after its next rescan
// (about a second), only when it lists the Hub cache the file went to
// (the hf_cache_dir setting), and not when a models dir file holds the id.
import { getJson } from './api.js';
import { h, replace } from './dom.js';

const WAIT_MS = 10000; // the library rescans within about a second
const POLL_MS = 1000;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// {ok: true} or {ok: false, why}; null while it may still show up.
async function lookUp(modelId, repoId) {
  const listed = (await getJson('v1/models')).data.find((m) => m.id === modelId);
  if (!listed) return null;
  const entry = ((await getJson('api/models')).data || []).find((m) => m.id === modelId);
  if (entry && repoId && entry.repo_id !== repoId) {
    return { ok: false, why: `the id is taken by ${entry.path}, which the library lists first; the downloaded file is not served under it.` };
  }
  if (listed.state === 'unusable') return { ok: false, why: `it is listed but cannot be served: ${listed.reason || 'no reason given'}.` };
  return { ok: true };
}

const NOT_LISTED = 'the service lists the Hugging Face cache of its hf_cache_dir setting (unset: the one HF_HUB_CACHE or HF_HOME names; "off": none), and the file may be in another, or removed since. The service\'s log names the cache it lists.';

// {ok} or {ok: false, why}, once listed or after WAIT_MS.
async function waitListed(modelId, repoId) {
  for (const until = Date.now() + WAIT_MS; Date.now() < until; await sleep(POLL_MS)) {
    const found = await lookUp(modelId, repoId);
    if (found) return found;
  }
  return { ok: false, listed: false, why: NOT_LISTED };
}

// The page renders a result several times as the job's state comes in: the
// renders of one page share one check (and one answer) through `checks`,
// which the page owns; a page opened again asks again.
function check(checks, modelId, repoId) {
  const key = `${modelId}\n${repoId ?? ''}`;
  if (!checks.has(key)) checks.set(key, waitListed(modelId, repoId));
  return checks.get(key);
}

// A span that becomes the chat link, or says why there is none.
export function listedModelLink(modelId, repoId, chatLink, checks) {
  const host = h('span', { class: 'listed-model small muted', role: 'status', text: 'Checking that the model is listed…' });
  check(checks, modelId, repoId).then((found) => {
    if (found.ok) {
      host.className = 'listed-model';
      replace(host, chatLink(modelId));
    } else {
      host.classList.add('not-listed');
      replace(host, found.listed === false
        ? `Not listed in /v1/models, so there is no chat link: ${found.why}`
        : `Not served: ${found.why}`);
    }
  }, (err) => replace(host, `Could not check /v1/models: ${err.message}`));
  return host;
}
