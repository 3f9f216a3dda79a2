// API: how to call this server's OpenAI-compatible API from code, with
// the base URL as this browser reaches it (right behind a proxy too) and
// copyable curl / Python / JavaScript snippets for the chosen model. What it
// says of keys follows the server's auth mode (`auth` in /healthz).
import { apiBase, getJson } from './api.js';
import { copyButton, h, replace } from './dom.js';

// The Python snippet's note on api_key, per auth mode.
const KEY_NOTES = {
  on: 'from gpuvisor keys add NAME',
  off: 'auth is off here: any text works',
  unknown: 'any text if the server has no keys',
};

export function snippets(base, model, auth = null) {
  const m = JSON.stringify(model);
  return [
    {
      id: 'curl', title: 'curl',
      code: `curl ${base}/chat/completions \\
  -H "Content-Type: application/json" \\
  -H "Authorization: Bearer $GPUVISOR_API_KEY" \\
  -d '{"model": ${m}, "messages": [{"role": "user", "content": "Hello!"}]}'`,
    },
    {
      id: 'python', title: 'Python (openai SDK)',
      code: `from openai import OpenAI

client = OpenAI(base_url="${base}", api_key="YOUR_API_KEY")  # ${KEY_NOTES[auth ?? 'unknown']}

response = client.responses.create(model=${m}, input="Hello!")
print(response.output_text)

# or Chat Completions, streamed
stream = client.chat.completions.create(
    model=${m},
    messages=[{"role": "user", "content": "Hello!"}],
    stream=True,
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="")`,
    },
    {
      id: 'javascript', title: 'JavaScript (fetch)',
      code: `const response = await fetch("${base}/chat/completions", {
  method: "POST",
  headers: {
    "Content-Type": "application/json",
    Authorization: "Bearer YOUR_API_KEY",
  },
  body: JSON.stringify({
    model: ${m},
    messages: [{ role: "user", content: "Hello!" }],
  }),
});
const data = await response.json();
console.log(data.choices[0].message.content);`,
    },
  ];
}

// The API key card: what a client must send, in the mode the server is in now.
function keyText(auth) {
  const bearer = () => h('code', { text: 'Authorization: Bearer <key>' });
  const add = () => h('code', { text: 'gpuvisor keys add NAME' });
  if (auth === 'on') {
    return ['Authentication is on: every /v1 request needs an API key, sent as ', bearer(),
      ' (the SDKs do this with ', h('code', { text: 'api_key' }), '). Create one with ', add(),
      '; ', h('code', { text: 'gpuvisor keys list' }), ' shows them.'];
  }
  if (auth === 'off') {
    return ['Authentication is off: /v1 accepts any key or none (the SDKs want some ', h('code', { text: 'api_key' }),
      '; any text works). ', add(), ' creates a key and turns authentication on: from then on every request needs one, sent as ',
      bearer(), '.'];
  }
  return ['When the server has API keys configured, send one as ', bearer(), ' (the SDKs do this with ', h('code', { text: 'api_key' }),
    '). Create one with ', add(), '.'];
}

function codeBlock(id, title, code) {
  return h('div', { class: 'code-block', dataset: { snippet: id } },
    h('div', { class: 'code-head' }, h('span', { class: 'code-lang', text: title }), copyButton(code)),
    h('pre', {}, h('code', { text: code })));
}

export function mount(root) {
  const base = apiBase();
  const modelSel = h('select', { id: 'api-model', name: 'model' }, h('option', { value: '', text: 'Loading models…' }));
  const snippetHost = h('div', { class: 'snippets' });
  let auth = null; // 'on' or 'off' once /healthz said
  const keyNote = h('p', { class: 'small key-note', text: 'Checking whether this server wants a key…' });
  const render = () => replace(snippetHost, snippets(base, modelSel.value || 'MODEL_ID', auth).map((s) => codeBlock(s.id, s.title, s.code)));
  const showAuth = (mode) => {
    auth = mode;
    keyNote.dataset.auth = mode ?? 'unknown';
    replace(keyNote, keyText(mode));
    render();
  };
  render();
  modelSel.addEventListener('change', render);

  root.append(
    h('div', { class: 'page-head' }, h('h1', { text: 'API' }),
      h('p', { class: 'muted', text: 'Use the models from your own code through the OpenAI-compatible API.' })),
    h('div', { class: 'split' },
      h('section', { class: 'card', 'aria-label': 'Snippets' },
        h('div', { class: 'field' }, h('label', { for: 'api-model', text: 'Model' }), modelSel),
        snippetHost),
      h('div', { class: 'side' },
        h('section', { class: 'card', 'aria-labelledby': 'api-base-title' },
          h('h2', { id: 'api-base-title', text: 'Base URL' }),
          h('div', { class: 'code-block base-url' },
            h('div', { class: 'code-head' }, h('span', { class: 'code-lang', text: 'base_url' }), copyButton(base)),
            h('pre', {}, h('code', { id: 'api-base', text: base }))),
          h('p', { class: 'small muted', text: 'As this browser reaches the server: use it from this machine or network. Endpoints: /responses, /chat/completions, /completions, /embeddings, /models.' })),
        h('section', { class: 'card', 'aria-labelledby': 'api-key-title' },
          h('h2', { id: 'api-key-title', text: 'API key' }), keyNote),
        h('section', { class: 'card', 'aria-labelledby': 'api-ref-title' },
          h('h2', { id: 'api-ref-title', text: 'Reference' }),
          h('p', { class: 'small' }, 'Every route, with its request and response schemas: ',
            h('a', { href: 'openapi.json', class: 'openapi-link', target: '_blank', rel: 'noopener', text: 'openapi.json' }), '.')))));

  // Unknown (an older server, or no answer): the card says what holds in either mode.
  getJson('healthz').then((body) => showAuth(['on', 'off'].includes(body.auth) ? body.auth : null), () => showAuth(null));
  getJson('api/models').then((body) => {
    const usable = body.data.filter((m) => m.usable);
    if (!usable.length) { replace(modelSel, h('option', { value: '', text: 'No usable model' })); render(); return; }
    replace(modelSel, usable.map((m) => h('option', { value: m.id, text: m.id })));
    modelSel.value = (usable.find((m) => m.state === 'ready') || usable[0]).id;
    render();
  }).catch(() => { replace(modelSel, h('option', { value: '', text: 'Could not list models' })); });
}
