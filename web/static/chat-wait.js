// A chat refused because a job holds the device (503 gpu_busy): say which
// job, how far it is and when it may end, and offer to wait in line. Waiting
// long-polls GET /api/models/{id}/wait with a ticket (the server keeps the
// place while it is polled) and shows the position until the device frees.
import { getJson, modelPath } from './api.js';
import { formatDuration, h } from './dom.js';

export function isDeviceBusy(err) {
  return err?.status === 503 && err.code === 'gpu_busy';
}

function jobLine(job) {
  if (!job) return 'A job holds the device.';
  const parts = [`${Math.round(job.progress * 100)} % done`];
  if (job.eta_s !== null && job.eta_s !== undefined) parts.push(`about ${formatDuration(job.eta_s)} left`);
  if (job.jobs_waiting) parts.push(`${job.jobs_waiting} more job${job.jobs_waiting === 1 ? '' : 's'} queued for it`);
  return [h('a', { href: `#/jobs/${encodeURIComponent(job.id)}`, text: `${job.kind || 'A'} job ${job.id}` }),
    ` holds the device (${parts.join(', ')}).`];
}

// The notice on a refused turn: the job, and a button to wait in line.
export function busyBox(err, waiting, onWait, onCancel) {
  const action = waiting
    ? h('button', { type: 'button', class: 'secondary wait-cancel', text: 'Stop waiting', onclick: onCancel })
    : h('button', { type: 'button', class: 'wait-in-line', text: 'Wait in line and send it then', onclick: onWait });
  return h('div', { class: 'notice warning busy', role: 'status' },
    h('p', {}, jobLine(err.job)),
    waiting ? h('p', { class: 'wait-position', text: waiting }) : null,
    h('p', {}, action));
}

export function positionText(state) {
  const ahead = state.position - 1;
  return ahead > 0
    ? `Waiting in line: number ${state.position} (${ahead} ahead of you). It sends by itself when the device is free.`
    : 'Waiting in line: next. It sends by itself when the device is free.';
}

// Poll until the device admits model workers; onUpdate(state) after each
// poll that is still waiting. Rejects with an AbortError when signal aborts.
export async function waitForDevice(model, signal, onUpdate) {
  let ticket = '';
  for (;;) {
    // The first poll answers at once (the position shows), later ones every
    // few seconds at most (the job's progress stays current).
    const q = new URLSearchParams({ timeout_s: ticket ? '3' : '0' });
    if (ticket) q.set('ticket', ticket);
    const state = await getJson(`api/models/${modelPath(model)}/wait?${q}`, { signal });
    if (state.ready) return;
    ticket = state.ticket;
    onUpdate(state);
  }
}
