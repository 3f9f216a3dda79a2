// The one way the UI talks to gpuvisor: fetch with the admin token (when one
// is set), OpenAI-shaped errors turned into ApiError, and a connection signal
// the shell shows as a banner.
import { h } from './dom.js';

const TOKEN_KEY = 'gpuvisor.adminToken';

export class ApiError extends Error {
  constructor(status, error = {}) {
    super(error.message || `request failed with HTTP ${status}`);
    this.status = status;
    this.type = error.type ?? null;
    this.param = error.param ?? null;
    this.code = error.code ?? null;
    this.job = error.job ?? null; // 503 gpu_busy: the job holding the device
  }
}

// "online" / "offline" events for the reconnecting banner. While offline the
// server is probed now and then, so the banner clears even on a page that has
// nothing left to fetch (say, a finished job's).
export const connection = new EventTarget();
const PROBE_MS = 3000;
let online = true;
let probing = false;
function setOnline(value) {
  if (value === online) return;
  online = value;
  connection.dispatchEvent(new Event(value ? 'online' : 'offline'));
  if (!value && !probing) probe();
}

async function probe() {
  probing = true;
  while (!online) {
    await new Promise((resolve) => setTimeout(resolve, PROBE_MS));
    if (online) break;
    try {
      setOnline(!fromProxy(await fetch('healthz', { cache: 'no-store' })));
    } catch {
      // still unreachable
    }
  }
  probing = false;
}

// A proxy in front answers 502/504 with its own page while gpuvisor is down.
function fromProxy(response) {
  return (response.status === 502 || response.status === 504)
    && !(response.headers.get('Content-Type') || '').includes('json');
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function forgetToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

// One prompt at a time: concurrent 401s share it.
let pendingPrompt = null;

function askToken(message) {
  pendingPrompt ??= promptDialog(message).finally(() => { pendingPrompt = null; });
  return pendingPrompt;
}

function promptDialog(message) {
  return new Promise((resolve) => {
    const input = h('input', { type: 'password', name: 'token', autocomplete: 'off', required: true, id: 'auth-token' });
    const dialog = h('dialog', { class: 'auth-dialog', 'aria-labelledby': 'auth-title' },
      h('form', { method: 'dialog' },
        h('h2', { id: 'auth-title', text: 'Admin token needed' }),
        h('p', { class: 'muted', text: message }),
        h('label', { for: 'auth-token', text: 'Token' }),
        input,
        h('p', { class: 'muted small', text: 'Kept in this tab only (session storage) and sent as a bearer token.' }),
        h('div', { class: 'actions' },
          h('button', { type: 'submit', value: 'cancel', class: 'secondary', formnovalidate: true, text: 'Cancel' }),
          h('button', { type: 'submit', value: 'ok', class: 'primary', text: 'Use token' }))));
    dialog.addEventListener('close', () => {
      const value = input.value.trim();
      dialog.remove();
      if (dialog.returnValue === 'ok' && value) {
        sessionStorage.setItem(TOKEN_KEY, value);
        resolve(value);
      } else {
        resolve(null);
      }
    });
    document.body.append(dialog);
    dialog.showModal();
    input.focus();
  });
}

function authHeaders(extra = {}) {
  const headers = { ...extra };
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  return headers;
}

async function errorFrom(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON (a proxy's error page): fall through to the status line
  }
  return new ApiError(response.status, body?.error ?? { message: `HTTP ${response.status} ${response.statusText}` });
}

// Returns the Response (ok); throws ApiError otherwise. Asks for the token once on 401.
// `path` is relative to the page ('api/jobs', never '/api/jobs'), so the UI
// keeps working when a proxy serves it under a path prefix.
export async function send(method, path, { json, body, headers = {}, signal } = {}) {
  const init = { method, signal, headers: { ...headers } };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers['Content-Type'] = 'application/json';
  } else if (body !== undefined) {
    init.body = body;
  }
  for (let attempt = 0; ; attempt++) {
    let response;
    try {
      response = await fetch(path, { ...init, headers: authHeaders(init.headers) });
    } catch (err) {
      if (err.name === 'AbortError') throw err;
      setOnline(false);
      throw new ApiError(0, { message: 'cannot reach gpuvisor (network error)', code: 'network_error' });
    }
    setOnline(!fromProxy(response));
    if (response.ok) return response;
    if (response.status === 401 && attempt === 0) {
      const err = await errorFrom(response);
      if (token()) forgetToken(); // the stored one was refused
      if (await askToken(err.message)) continue;
      throw err;
    }
    throw await errorFrom(response);
  }
}

export async function getJson(path, opts) {
  return (await send('GET', path, opts)).json();
}

export async function postJson(path, json, opts = {}) {
  return (await send('POST', path, { ...opts, json })).json();
}

export async function del(path) {
  return (await send('DELETE', path)).json();
}

export async function getText(path, opts) {
  return (await send('GET', path, opts)).text();
}

export async function uploadDataset(file) {
  const form = new FormData();
  form.append('file', file, file.name);
  return (await send('POST', 'api/datasets', { body: form })).json();
}

// Model ids may contain '/', kept as path separators.
export function modelPath(id) {
  return id.split('/').map(encodeURIComponent).join('/');
}

// Which routes this server has, from its OpenAPI document (fetched once), so
// the UI can use a newer route without asking an older server for it.
let spec = null;
export function hasRoute(method, path) {
  spec ??= getJson('openapi.json').catch(() => ({ paths: {} }));
  return spec.then((doc) => Boolean(doc.paths?.[path]?.[method.toLowerCase()]));
}

// The lease's device ids (GET api/gpu); [] when they cannot be read (an
// older server, a failed request): callers then show what they stored.
export function leaseDevices() {
  return getJson('api/gpu').then((g) => (g.devices || []).map((d) => d.id), () => []);
}

// A machine without a GPU: the lease's only device is `cpu`.
export function cpuOnly(deviceIds) {
  return deviceIds.length > 0 && deviceIds.every((id) => id === 'cpu');
}

// The base URL of the OpenAI-compatible API as this browser reaches it
// (right behind a proxy, under a path prefix too).
export function apiBase() {
  return new URL('v1', document.baseURI).href;
}
