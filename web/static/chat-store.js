// Saved chat conversations, in this browser's localStorage. A stored
// Responses API conversation is a chain through previous_response_id: each
// entry keeps the last response id (to continue it), every response id (to
// delete them on the server) and the turns as shown (to show it again).
import { savedCall } from './chat-calls.js';

const KEY = 'gpuvisor.chats';
const MAX_CONVERSATIONS = 50;
const MAX_TURN_CHARS = 20_000;

export function listConversations() {
  try {
    const list = JSON.parse(localStorage.getItem(KEY) || '[]');
    return Array.isArray(list) ? list.sort((a, b) => (b.updated || 0) - (a.updated || 0)) : [];
  } catch {
    return [];
  }
}

function write(list) {
  for (let keep = list.length; keep >= 0; keep--) {
    try {
      localStorage.setItem(KEY, JSON.stringify(list.slice(0, keep)));
      return;
    } catch {
      // over the quota: drop the oldest and try again
    }
  }
}

export function getConversation(id) {
  return listConversations().find((c) => c.id === id) || null;
}

export function newConversationId() {
  return `chat-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}

export function titleFrom(text) {
  const line = text.replace(/\s+/g, ' ').trim();
  return line.length > 60 ? `${line.slice(0, 57)}…` : line || 'Untitled chat';
}

// Only what is needed to show a turn again.
function storedTurn(t) {
  return {
    user: t.user.slice(0, MAX_TURN_CHARS), text: t.text.slice(0, MAX_TURN_CHARS), reasoning: t.reasoning.slice(0, MAX_TURN_CHARS),
    model: t.model, status: t.status === 'streaming' ? 'stopped' : t.status, usage: t.usage, tps: t.tps, seconds: t.seconds,
    error: t.error ? { message: t.error.message || String(t.error) } : null, responseId: t.responseId || null,
    calls: (t.calls || []).map(savedCall),
  };
}

export function saveConversation(conv) {
  const list = listConversations().filter((c) => c.id !== conv.id);
  list.unshift({ ...conv, turns: conv.turns.map(storedTurn), updated: Date.now() });
  write(list.slice(0, MAX_CONVERSATIONS));
}

export function renameConversation(id, title) {
  const list = listConversations();
  const conv = list.find((c) => c.id === id);
  if (conv) { conv.title = title.trim() || conv.title; write(list); }
}

export function removeConversation(id) {
  write(listConversations().filter((c) => c.id !== id));
}
