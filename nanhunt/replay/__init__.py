"""Replays: a module call, an optimizer step or a whole kept step run again on copies of what the
training step used, all under one contract (:mod:`nanhunt.contract`: nothing the user can observe
changes). :mod:`.ops` records the aten ops; :mod:`.module` replays the culprit module and names
the op and source line; :mod:`.optimizer` replays an optimizer step; :mod:`.step` replays a
sentinel's kept step under full tracing; :mod:`.checks` replays recommendations; :mod:`.files`
reads and writes snapshot files; :mod:`.show` prints a replay."""
