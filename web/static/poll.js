// Periodic refresh for pages without a push stream. One run at a time (the
// next starts after the previous settles), paused while the tab is hidden.
export function poll(fn, intervalMs) {
  let timer = null;
  let stopped = false;
  let running = false;

  async function tick() {
    timer = null;
    if (stopped || running) return;
    if (document.hidden) return; // resumed by visibilitychange
    running = true;
    try {
      await fn();
    } finally {
      running = false;
      if (!stopped) timer = setTimeout(tick, typeof intervalMs === 'function' ? intervalMs() : intervalMs);
    }
  }
  function onVisible() {
    if (!document.hidden && timer === null && !running) tick();
  }
  document.addEventListener('visibilitychange', onVisible);
  tick();
  return {
    now() { if (timer !== null) { clearTimeout(timer); tick(); } },
    stop() {
      stopped = true;
      if (timer !== null) clearTimeout(timer);
      document.removeEventListener('visibilitychange', onVisible);
    },
  };
}
