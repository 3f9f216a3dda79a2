"""Poison requests: one client's crashing request must not fail a model for everybody.

The rule, per model:

- When a worker crashes, every request in flight then is a *suspect*: its
  fingerprint (a hash of what the worker reads from it: messages or prompt,
  images, tools, template variables, grammar or JSON schema; not the seed,
  temperature or token limits) is remembered.
- A suspect in flight during a second crash is a *poison* request: refused
  from then on with 400 ``request_crashed_worker`` before it reaches a worker.
- A crash counts toward the model's crash limit unless every request in
  flight was already a suspect: the crash that first made them suspects
  counted, their repeats do not. A crash with nothing in flight, or with any
  new request in flight, counts as before, so a model that crashes on
  innocent traffic still ends ``failed``.
- A changed byte makes a new fingerprint, so crashes are also blamed on the
  callers in flight, who are refused once they keep crashing workers
  (supervisor/workers/crash_keys.py, which applies both rules).

Both are remembered for ``ttl`` seconds after their last crash, at most
``max_entries`` of them (least recently crashed first out).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import msgspec

from worker import protocol as p

Message = p.Generate | p.Embed | p.Tokenize

MAX_ENTRIES = 256
TTL_S = 3600.0


def fingerprint(model_id: str, msg: Message) -> str:
    """What a request asks the worker to read, hashed; equal for a repeated request."""
    content: object
    if isinstance(msg, p.Generate):
        s = msg.params
        content = ("generate", msg.messages, msg.prompt, msg.tools, msg.template_vars,
                   [hashlib.sha256(image).hexdigest() for image in msg.images],
                   s.grammar, s.json_schema, s.json_object)
    elif isinstance(msg, p.Embed):
        content = ("embed", msg.inputs)
    else:
        content = ("tokenize", msg.text, msg.add_special)
    # Sorted keys: the same JSON object in another key order is the same request.
    # JSON, not msgpack: a request's JSON may hold integers beyond 64 bits (a
    # tool schema's), which msgpack cannot encode; JSON writes any integer.
    body = msgspec.json.encode((model_id, content), order="sorted")
    return hashlib.sha256(body).hexdigest()


class PoisonTracker:
    """Suspect and poison fingerprints (see the module's rule)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, ttl: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self.clock = clock
        # fingerprint -> (crashes it was in flight for, time of the last one); oldest first.
        self._seen: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def _crashes(self, fp: str, now: float) -> int:
        entry = self._seen.get(fp)
        if entry is None:
            return 0
        if now - entry[1] > self.ttl:
            del self._seen[fp]
            return 0
        return entry[0]

    def __len__(self) -> int:
        return len(self._seen)

    def is_poison(self, fp: str) -> bool:
        return self._crashes(fp, self.clock()) >= 2

    def crashed(self, in_flight: Iterable[str]) -> bool:
        """Record a crash with these fingerprints in flight; True when it
        counts toward the crash limit."""
        now = self.clock()
        fps = set(in_flight)
        before = {fp: self._crashes(fp, now) for fp in fps}
        for fp, n in before.items():
            self._seen[fp] = (n + 1, now)
            self._seen.move_to_end(fp)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return not fps or any(n == 0 for n in before.values())
