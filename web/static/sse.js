// Server-Sent Events over fetch rather than EventSource: it can send the
// bearer token and POST bodies (for /v1/responses), and we control
// reconnects and Last-Event-ID ourselves.
import { ApiError, send } from './api.js';

// Yields {event, data, id} for each message of a text/event-stream body;
// `retry` fields are reported as {retry}.
export async function* readEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  let data = [];
  let event = '';
  let id = null;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop(); // an incomplete last line waits for more
      for (const line of lines) {
        if (line === '') {
          if (data.length) yield { event: event || 'message', data: data.join('\n'), id };
          data = [];
          event = '';
          continue;
        }
        if (line.startsWith(':')) continue; // comment / keepalive
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? '' : line.slice(colon + 1);
        if (val.startsWith(' ')) val = val.slice(1);
        if (field === 'data') data.push(val);
        else if (field === 'event') event = val;
        else if (field === 'id') id = val;
        else if (field === 'retry' && /^\d+$/.test(val)) yield { retry: Number(val) };
      }
    }
  } finally {
    reader.releaseLock();
  }
}

// A resuming event stream. States: connecting, live, reconnecting, ended, error.
// `onEvent({event, data, id})` gets each message once, in order, across reconnects.
export class EventStream {
  constructor(url, { onEvent, onState, finalEvent = 'end' }) {
    this.url = url;
    this.onEvent = onEvent;
    this.onState = onState || (() => {});
    this.finalEvent = finalEvent;
    this.lastId = null;
    this.retryMs = 2000;
    this.controller = null;
    this.closed = false;
  }

  start() {
    this.loop();
    return this;
  }

  close() {
    this.closed = true;
    this.controller?.abort();
  }

  async loop() {
    let failures = 0;
    this.onState('connecting');
    while (!this.closed) {
      this.controller = new AbortController();
      const headers = { Accept: 'text/event-stream' };
      if (this.lastId !== null) headers['Last-Event-ID'] = this.lastId;
      try {
        const response = await send('GET', this.url, { headers, signal: this.controller.signal });
        this.onState('live');
        failures = 0;
        for await (const msg of readEvents(response)) {
          if (this.closed) return;
          if (msg.retry !== undefined) { this.retryMs = msg.retry; continue; }
          if (msg.id !== null) this.lastId = msg.id;
          this.onEvent(msg);
          if (msg.event === this.finalEvent) {
            this.closed = true;
            this.controller.abort();
            this.onState('ended');
            return;
          }
        }
      } catch (err) {
        if (this.closed) return;
        // A client error (404, 400, 401 refused) will not heal by retrying.
        if (err instanceof ApiError && err.status >= 400 && err.status < 500 && err.status !== 429) {
          this.closed = true;
          this.onState('error', err);
          return;
        }
      }
      if (this.closed) return;
      // The stream broke (network blip, parent restart): resume after lastId.
      failures++;
      this.onState('reconnecting');
      const delay = Math.min(15000, this.retryMs * Math.min(failures, 5));
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }
}
