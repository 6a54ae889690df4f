"""Qualified module and parameter names, as in the user's ``model.named_modules()``."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from nanhunt.capture._util import _owner_of, _unwrap, _variable_name
from nanhunt.capture.state import _Frame

#: the attribute a nested wrapper keeps the user's module under (FSDP1, activation
#: checkpointing's checkpoint_wrapper): not part of the name the user wrote
_WRAPPED = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def clean(qual: str) -> str:
    """A qualified name without nested wrappers' attributes (``3._fsdp_wrapped_module`` ->
    ``3``): the wrapper and the module it wraps share the user's name, as torch's own
    ``named_parameters`` of those wrappers do."""
    if "_wrapped_module" not in qual:
        return qual
    return ".".join(part for part in qual.split(".") if part not in _WRAPPED)


class Naming:
    """Names modules from their roots (modules nobody else contains); a root's parameters are
    handed to ``on_param`` once each (the autograd observer hooks their accumulated gradients)."""

    def __init__(self, on_param: Any = None) -> None:
        self.on_param = on_param
        self.names = WeakIdKeyDictionary()  # module -> name
        self.types: dict[str, str] = {}  # name -> class name (kept after the session ends)
        self.params: dict[str, int] = {}  # name -> elements of its own parameters
        self.released: dict[int, str] = {}
        self.roots: list[tuple[weakref.ref, str]] = []
        self.param_names = WeakIdKeyDictionary()  # parameter -> (name, owner module name)
        self._primary_set = False
        self._primary_root: weakref.ref | None = None
        self._lazy = False  # a lazy module's parameters still await their first forward

    def is_primary(self, root: nn.Module) -> bool:
        """Whether ``root`` is the model whose modules are named without a prefix."""
        return self._primary_root is not None and self._primary_root() is root

    def release(self) -> None:
        """Drop every reference to the user's modules (the types stay for the layer table)."""
        # names by id, for a crash's traceback (whose frames keep those modules alive)
        self.released = {id(m): name for m, name in self.names.items()}
        self.names = WeakIdKeyDictionary()
        self.param_names = WeakIdKeyDictionary()
        self.roots = []

    def add_root(self, root: nn.Module, *, primary: bool = False,
                 label: str | None = None) -> None:
        label = label or _variable_name(root) or type(root).__name__
        has_params = next(root.parameters(), None) is not None
        if self._primary_root is not None and self._primary_root() is root:
            primary = True  # named again (a lazy or late module): keep its names
        elif not self._primary_set and (primary or has_params):
            primary, self._primary_set = True, True
            self._primary_root = weakref.ref(root)
        else:
            primary = False
        if all(ref() is not root for ref, _ in self.roots):
            self.roots.append((weakref.ref(root), label))
        inner = _unwrap(root)
        if inner is not root and self._primary_root is not None \
                and self._primary_root() is inner and inner in self.names:
            # DDP around the model the session was given (a framework wraps it after the
            # session started): the wrapper takes the model's name, its modules keep theirs
            self.names[root] = self.names[inner]
            return
        if inner is not root:  # DDP & co: name the user's modules as in their own model
            self.names[root] = label
            self.types[label] = type(root).__name__
            root = inner
        for qual, mod in root.named_modules():
            qual = clean(qual)
            name = (qual or label) if primary else (f"{label}.{qual}" if qual else label)
            self.names[mod] = name
            self.types[name] = type(mod).__name__
            self.params[name] = 0
            for pname, p in mod.named_parameters(recurse=False):
                if isinstance(p, nn.parameter.UninitializedParameter):
                    self._lazy = True  # named again once a forward has materialised it
                    continue
                self.params[name] += p.numel()
                if p.requires_grad and p not in self.param_names:
                    full = (f"{qual}.{pname}" if qual else pname) if primary else \
                        f"{name}.{pname}"
                    self.param_names[p] = (full, name)
                    if self.on_param is not None:
                        self.on_param(p)

    def name_of(self, module: nn.Module, frames: list[_Frame]) -> str:
        name = self.names.get(module)
        if name is not None:
            if self._lazy and not frames:
                self._lazy = False
                for ref, label in list(self.roots):
                    root = ref()
                    if root is not None and any(m is module for m in root.modules()):
                        self.add_root(root, label=label)
            return name
        if frames:
            # a module created after its root was named: look again, then name it by its class
            for ref, _label in self.roots:
                root = ref()
                if root is not None and any(m is module for m in root.modules()):
                    self.add_root(root, label=_label)
                    name = self.names.get(module)
                    if name is not None:
                        return name
            name = f"{frames[-1].name}.<{type(module).__name__}>"
            self.names[module] = name
            self.types[name] = type(module).__name__
            return name
        self.add_root(_owner_of(module))
        return self.names[module]
