// Streaming a chat turn: through /v1/responses (continuing with
// previous_response_id), or, on a server without it, through
// /v1/chat/completions with the history kept here. Both report the same
// callbacks: onReasoning(text), onText(text), onDone({usage, status, id}).
// Images (data: URLs) go with the turn's text as input_image / image_url parts.
// Hosted tools (`tools`, `include`, `toolChoice`) go only through
// /v1/responses; every event the page may follow that is not text (the
// hosted calls: chat-calls.js) goes to onEvent(event).
import { ApiError, send } from './api.js';
import { readEvents } from './sse.js';

// A 404 for the route itself (not for the model) means the API is absent.
function routeMissing(err) {
  return err instanceof ApiError && err.status === 404 && err.code === 'not_found';
}

export class ChatSession {
  constructor() {
    this.mode = 'responses'; // or 'chat' after falling back
    this.previousId = null;
    this.history = []; // chat-completions messages, only used when falling back
  }

  reset() {
    this.previousId = null;
    this.history = [];
  }

  async turn({ model, text, images = [], instructions, maxTokens, temperature, tools = [], include = [], toolChoice = null, signal }, cb) {
    if (this.mode === 'responses') {
      try {
        return await this.viaResponses({ model, text, images, instructions, maxTokens, temperature, tools, include, toolChoice, signal }, cb);
      } catch (err) {
        if (!routeMissing(err)) throw err;
        this.mode = 'chat';
        cb.onFallback?.();
      }
    }
    return this.viaChat({ model, text, images, instructions, maxTokens, temperature, signal }, cb);
  }

  async viaResponses({ model, text, images = [], instructions, maxTokens, temperature, tools = [], include = [], toolChoice = null, signal }, cb) {
    const input = images.length ? [{
      role: 'user',
      content: [{ type: 'input_text', text }, ...images.map((url) => ({ type: 'input_image', image_url: url, detail: 'auto' }))],
    }] : text;
    const body = { model, input, stream: true, store: true };
    if (this.previousId) body.previous_response_id = this.previousId;
    if (instructions) body.instructions = instructions;
    if (maxTokens) body.max_output_tokens = maxTokens;
    if (temperature !== null && temperature !== undefined) body.temperature = temperature;
    if (tools.length) body.tools = tools;
    if (tools.length && include.length) body.include = include;
    if (tools.length && toolChoice) body.tool_choice = toolChoice;
    const response = await send('POST', 'v1/responses', { json: body, signal, headers: { Accept: 'text/event-stream' } });
    let id = null;
    for await (const msg of readEvents(response)) {
      if (msg.data === undefined) continue;
      const ev = JSON.parse(msg.data);
      switch (ev.type) {
        case 'response.created':
          id = ev.response.id;
          cb.onStart?.(id);
          break;
        case 'response.output_text.delta':
          cb.onText(ev.delta);
          break;
        case 'response.reasoning_text.delta':
        case 'response.reasoning_summary_text.delta':
          cb.onReasoning(ev.delta);
          break;
        case 'response.completed':
        case 'response.incomplete':
          this.previousId = ev.response.id;
          return { id: ev.response.id, status: ev.response.status, usage: ev.response.usage, incomplete: ev.response.incomplete_details };
        case 'response.failed':
          throw new ApiError(500, ev.response.error || { message: 'the response failed' });
        case 'error':
          throw new ApiError(500, ev.error || ev);
        default:
          cb.onEvent?.(ev);
          break;
      }
    }
    throw new ApiError(0, { message: 'the stream ended before the response finished', code: 'stream_cut' });
  }

  async viaChat({ model, text, images = [], instructions, maxTokens, temperature, signal }, cb) {
    const messages = [];
    if (instructions) messages.push({ role: 'system', content: instructions });
    const content = images.length
      ? [{ type: 'text', text }, ...images.map((url) => ({ type: 'image_url', image_url: { url } }))] : text;
    messages.push(...this.history, { role: 'user', content });
    const body = { model, messages, stream: true, stream_options: { include_usage: true } };
    if (maxTokens) body.max_tokens = maxTokens;
    if (temperature !== null && temperature !== undefined) body.temperature = temperature;
    const response = await send('POST', 'v1/chat/completions', { json: body, signal, headers: { Accept: 'text/event-stream' } });
    let answer = '';
    let usage = null;
    let finish = null;
    for await (const msg of readEvents(response)) {
      if (msg.data === undefined) continue;
      if (msg.data === '[DONE]') break;
      const chunk = JSON.parse(msg.data);
      if (chunk.error) throw new ApiError(500, chunk.error);
      if (chunk.usage) {
        usage = { input_tokens: chunk.usage.prompt_tokens, output_tokens: chunk.usage.completion_tokens, total_tokens: chunk.usage.total_tokens };
      }
      const choice = chunk.choices?.[0];
      if (choice?.delta?.reasoning_content) cb.onReasoning(choice.delta.reasoning_content);
      if (choice?.delta?.content) { answer += choice.delta.content; cb.onText(choice.delta.content); }
      if (choice?.finish_reason) finish = choice.finish_reason;
    }
    this.history.push({ role: 'user', content }, { role: 'assistant', content: answer });
    return { id: null, status: finish === 'length' ? 'incomplete' : 'completed', usage };
  }
}
