"""Replays: a module call, a whole step or an optimizer step run again on copies of what the
training step used (:mod:`.zoom` names the op and the source line; :mod:`.step` replays a
sentinel's kept step under full tracing)."""
