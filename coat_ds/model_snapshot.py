"""What coat_hf.convert_to_coat changes on a model, recorded before it runs so that it can be undone: the class of
every module, the `coat*` attributes (a decoder layer's LayerState, the model's CoatRuntime) and, for layers already
converted, the LayerState's config and graphs, which a second conversion replaces in place.

The engine hook converts the model at the start of DeepSpeedEngine.__init__, before DeepSpeed's own checks of the
config: when those refuse it (fp16 on a CPU, say), the model is restored, so the caller holds the model it passed.
"""
from __future__ import annotations

_MISSING = object()


class ModelSnapshot:
    def __init__(self, model):
        self._modules = []
        for module in model.modules():
            attributes = {k: v for k, v in vars(module).items() if k.startswith("coat")}
            state = attributes.get("coat")
            layer_fields = (state.config, state.graphs) if hasattr(state, "config") and hasattr(state, "graphs") \
                else None
            self._modules.append((module, type(module), attributes, layer_fields))

    def restore(self) -> None:
        for module, cls, attributes, layer_fields in self._modules:
            module.__class__ = cls
            for key in [k for k in vars(module) if k.startswith("coat") and k not in attributes]:
                delattr(module, key)
            for key, value in attributes.items():
                setattr(module, key, value)
            if layer_fields is not None:
                module.coat.config, module.coat.graphs = layer_fields
