"""coat_ds.patch_sites, the ledger of what coat_ds changes in DeepSpeed and which DeepSpeed internals it reads, in step
with the code: no patch applied outside the ledger, no private DeepSpeed attribute read without an entry, no entry
left that the code no longer uses, every pinning test present, and after registration every module- and class-level
patch in place over an attribute this DeepSpeed has."""
import ast
import inspect
import re
from pathlib import Path

import pytest

from coat_ds import patch_sites
from coat_ds.patch_sites import INTERNALS, PATCHES, PatchSite

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "coat_ds"
APPLIES_PATCHES = "coat_ds.patch_sites"
# runs at interpreter start-up, before coat_ds can be imported: its patch is the ledger's IMPORT_HOOK
STANDALONE = "coat_ds._autoregister"
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "remove", "clear", "__setitem__"}
OWN = {"self", "cls", "super"}  # super() reads are the object's own
NOT_DEEPSPEED = {"state"}  # a torch optimizer's state (CoatFP8AdamW's own)
MODEL_ONLY = {"coat_ds.model_snapshot"}  # writes only the user's model (undoing coat_hf's conversion), never DeepSpeed


def package_sources() -> dict[str, str]:
    return {f"coat_ds.{path.stem}" if path.stem != "__init__" else "coat_ds": path.read_text()
            for path in sorted(PACKAGE.glob("*.py"))}


def internal_names() -> set[str]:
    return {name for internal in INTERNALS for name in internal.names}


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _written_attribute(target):
    """The attribute an assignment target writes into, when it belongs to an object other than self: `x.a = v`,
    `x.a[i] = v`."""
    if isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Attribute) and _root_name(target) not in OWN:
        return target.attr
    return None


def raw_patches(source: str, allowed: set[str]) -> list[str]:
    """Changes to other objects' attributes that do not go through coat_ds.patch_sites: setattr, assignments to (or
    into) an attribute of an object other than self, and list/dict mutators called on such an attribute, except for
    attributes named in `allowed`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append(f"line {node.lineno}: setattr")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            for target in flat:
                name = _written_attribute(target)
                if name is not None and name not in allowed:
                    found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and isinstance(node.func.value, ast.Attribute) and _root_name(node.func.value) not in OWN
              and node.func.value.attr not in allowed):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}(...)")
    return sorted(found, key=lambda line: int(line.split(":")[0].split()[1]))


def private_reads(source: str) -> set[str]:
    """Private attributes (`x._name`, getattr/hasattr(x, "_name")) of objects other than self."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and _root_name(node) not in OWN):
            found.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_") and not str(node.args[1].value).startswith("__")):
            found.add(node.args[1].value)
    return found


def test_no_patch_outside_the_ledger():
    """Every change of a DeepSpeed (or torch.optim) attribute goes through coat_ds.patch_sites with its entry; only
    the ledger's INTERNALS (ZeRO-3's ds_id, the master-partition lists) are written directly."""
    sources = package_sources()
    assert {site.applied_in for site in PATCHES} <= set(sources)
    assert any(site.applied_in == STANDALONE for site in PATCHES)
    outside = {module: raw_patches(source, internal_names() | NOT_DEEPSPEED) for module, source in sources.items()
               if module not in (APPLIES_PATCHES, STANDALONE) and module not in MODEL_ONLY}
    assert not {module: found for module, found in outside.items() if found}, (
        "patch through coat_ds.patch_sites (with a PatchSite entry), or list the internal in patch_sites.INTERNALS")


def test_the_scan_sees_patches():
    allowed = internal_names()
    planted = ("def register():\n"
               "    DeepSpeedEngine.step = step\n"
               "    setattr(torch.optim, 'X', X)\n"
               "    zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(X)\n"
               "    zero_optimizer.state_dict, other.flag = lambda: {}, True\n"
               "    engine.optimizer.param_groups[0] = {}\n"
               "    self.fine = 1\n"
               "    own.ds_id = master.ds_id\n")
    assert [line.split(":")[0] for line in raw_patches(planted, allowed)] == [f"line {n}" for n in (2, 3, 4, 5, 5, 6)]


def test_every_private_deepspeed_attribute_read_is_in_the_ledger():
    listed = internal_names() | {site.attribute for site in PATCHES}
    unlisted = {module: sorted(private_reads(source) - listed) for module, source in package_sources().items()
                if module not in (APPLIES_PATCHES, STANDALONE)}
    assert not {module: names for module, names in unlisted.items() if names}, "add them to patch_sites.INTERNALS"


def test_every_entry_is_used_by_the_code_it_names():
    sources = package_sources()
    constants = {id(value): name for name, value in vars(patch_sites).items() if isinstance(value, PatchSite)}
    assert {id(value) for value in vars(patch_sites).values() if isinstance(value, PatchSite)} == set(map(id, PATCHES))
    for site in PATCHES:
        if site.applied_in != STANDALONE:
            assert f"patch_sites.{constants[id(site)]}" in sources[site.applied_in], site
        else:
            assert f".{site.attribute} = " in sources[site.applied_in], site
    for internal in INTERNALS:
        code = " ".join(sources[module] for module in internal.used_in)
        missing = [name for name in internal.names if not re.search(rf"\b{re.escape(name)}\b", code)]
        assert not missing, f"{internal.of}: {missing} no longer used in {internal.used_in}"
        for module in internal.used_in:
            assert any(re.search(rf"\b{re.escape(name)}\b", sources[module]) for name in internal.names), (
                f"{module} uses none of {internal.names}")


def test_every_pinning_test_exists():
    pins = {pin for entry in PATCHES + INTERNALS for pin in entry.pinned_by}
    for pin in sorted(pins):
        path, _, name = pin.partition("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE), pin
    assert all(entry.pinned_by for entry in PATCHES + INTERNALS)


def test_every_class_and_module_patch_is_in_place_after_registration():
    """Against the installed DeepSpeed: every attribute the ledger patches exists, and registering puts each module-
    and class-level patch in place over DeepSpeed's original (once: registering again changes nothing)."""
    pytest.importorskip("deepspeed")
    from coat_ds.deepspeed_plugin import register_with_deepspeed

    register_with_deepspeed()
    # an attribute patched on instances may be one that the class's __init__ sets (ZeRO-1/2's `flatten`)
    made_by_init = [(site, owner) for site in PATCHES for owner in site.owners
                    if not hasattr(patch_sites.resolve(owner), site.attribute)]
    for site, owner in made_by_init:
        assert site.change == "wrapped on the instance", (site, owner)
        assert f"self.{site.attribute} = " in inspect.getsource(patch_sites.resolve(owner).__init__), (site, owner)
    before = {(site, owner): getattr(patch_sites.resolve(owner), site.attribute)
              for site in PATCHES for owner in site.owners if (site, owner) not in made_by_init}
    register_with_deepspeed()
    for site in PATCHES:
        if any(s is site for s, _ in made_by_init):
            continue
        for owner in site.owners:
            current = getattr(patch_sites.resolve(owner), site.attribute)
            assert current is before[(site, owner)], f"{owner}.{site.attribute} replaced again"
        if site.change in ("set", "wrapped"):
            assert patch_sites.is_applied(site), site
        if site.change == "wrapped":
            original = getattr(patch_sites.resolve(site.owners[0]), site.attribute).__wrapped__
            assert original.__module__.startswith("deepspeed"), (site, original)
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    import coat_ds
    assert ZERO_SUPPORTED_OPTIMIZERS.count(coat_ds.CoatFP8AdamW) == 1


def test_registering_again_under_another_librarys_wrapper_wraps_nothing_twice(monkeypatch):
    pytest.importorskip("deepspeed")
    import functools

    from deepspeed.runtime.engine import DeepSpeedEngine

    from coat_ds.deepspeed_plugin import register_with_deepspeed

    register_with_deepspeed()
    ours = DeepSpeedEngine.__init__
    theirs = functools.wraps(ours)(lambda self, *args, **kwargs: ours(self, *args, **kwargs))
    monkeypatch.setattr(DeepSpeedEngine, "__init__", theirs)
    register_with_deepspeed()
    assert DeepSpeedEngine.__init__ is theirs and patch_sites.is_applied(patch_sites.ENGINE_INIT)
