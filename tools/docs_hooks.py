"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``), and what the docs tests reuse.

Two pages are generated at build time, so they cannot go stale:

* ``docs/cli.md``: ``<!-- GENERATED: cli -->`` becomes the ``--help`` of ``dml-optim`` and of every
  subcommand, formatted by the parser itself (:func:`cli_markdown`).
* ``docs/api.md``: ``<!-- GENERATED: api -->`` becomes one mkdocstrings entry per name of
  ``dml_optim.__all__`` (:func:`api_markdown`), so a name added there is documented without editing the page.
* each optimizer page: ``<!-- GENERATED: arguments CLASS -->`` becomes the table of the constructor's
  arguments: default, meaning (the docstring's ``Args:``) and torch.optim's name (:func:`arguments_markdown`).

The build also fails (under ``mkdocs build --strict``) when a public name has no docstring
(:func:`missing_docstrings`).  Attributes are documented the way this project writes it, with a ``#:``
comment above the assignment; :class:`DocComments` hands those to griffe, which mkdocstrings renders from.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator

import griffe

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("mkdocs.plugins.dml_optim")

#: The width ``--help`` is formatted at on the CLI page (and by the test that compares it with the command).
HELP_COLUMNS = 100
#: Public names known to lack a docstring, each with who must add it: the check reports a name listed
#: here that has one (then remove it from here), and does not fail on the others.
KNOWN_MISSING: dict[str, str] = {}


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([\w.]+)`")
_DIRECTIVE = re.compile(r"^(\s*)\.\. (warning|note)::", flags=re.M)


class DocComments(griffe.Extension):
    """Give an attribute without a docstring the ``#:`` comment lines right above its assignment, and write the
    docstrings' reST roles and directives (``:class:`~dml_optim.AdamW```, ``.. warning::``) as Markdown."""

    def on_instance(self, *, node: ast.AST | griffe.ObjectNode, obj: griffe.Object,
                    agent: griffe.Visitor | griffe.Inspector, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _ROLE.sub(lambda m: f"`{m.group(1)}`", obj.docstring.value)
            obj.docstring.value = _DIRECTIVE.sub(lambda m: f"{m.group(1)}**{m.group(2).capitalize()}:**", text)

    def on_attribute_instance(self, *, node: ast.AST | griffe.ObjectNode, attr: griffe.Attribute,
                              agent: griffe.Visitor | griffe.Inspector, **kwargs: Any) -> None:
        if attr.docstring is not None or attr.lineno is None or not isinstance(attr.parent, griffe.Module):
            return
        lines = attr.parent.lines
        doc, i = [], attr.lineno - 2
        while i >= 0 and lines[i].lstrip().startswith("#:"):
            doc.insert(0, lines[i].lstrip()[2:].strip())
            i -= 1
        if doc:
            attr.docstring = griffe.Docstring(" ".join(doc), lineno=i + 2, parent=attr)


def public_names() -> list[str]:
    """``dml_optim.__all__``, in its order."""
    import dml_optim

    return list(dml_optim.__all__)


@functools.lru_cache(maxsize=1)
def load_package() -> griffe.Module:
    """``dml_optim`` as griffe (and so mkdocstrings) reads it, ``#:`` comments included."""
    extensions = griffe.load_extensions(DocComments)
    return griffe.load("dml_optim", search_paths=[str(ROOT)], extensions=extensions, resolve_aliases=True,
                       resolve_external=False)


def missing_docstrings() -> list[str]:
    """The public names whose object (an alias resolved to its target) has no docstring."""
    package = load_package()
    missing = []
    for name in public_names():
        obj = package[name]
        target = obj.final_target if obj.is_alias else obj
        if target.docstring is None or not target.docstring.value.strip():
            missing.append(name)
    return missing


def api_markdown() -> str:
    """One mkdocstrings entry per public name: the API page's body."""
    return "\n".join(f"::: dml_optim.{name}\n" for name in public_names())


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    """``COLUMNS=width`` while the block runs (argparse reads it to wrap ``--help``)."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def command_helps() -> dict[str, str]:
    """``""`` (the top level) and each subcommand's name -> its ``--help`` text at :data:`HELP_COLUMNS`."""
    import argparse

    from dml_optim.cli import COMMANDS, build_parser

    with _columns(HELP_COLUMNS):
        parser = build_parser()
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        helps = {"": parser.format_help()}
        helps.update((name, sub.choices[name].format_help()) for name in COMMANDS)
    return helps


def cli_markdown() -> str:
    """The CLI page's generated part: each command's ``--help`` under its own heading."""
    parts = []
    for name, text in command_helps().items():
        title = f"dml-optim {name}".strip()
        parts.append(f"## `{title}` {{#{name or 'dml-optim'}}}\n\n```text\n$ {title} --help\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


#: Meanings of the torch.optim flags some constructors take for torch's signature (no hyperparameter of ours).
_TORCH_FLAGS = {
    "foreach": "accepted for torch's signature and kept in the param groups; changes nothing (every step is flat)",
    "fused": "accepted for torch's signature and kept in the param groups; changes nothing (every step is flat)",
    "differentiable": "`True` is refused",
    "capturable": "step counts and coefficients on the device, for CUDA graphs (an option, see Options)",
}


def _torch_name(cls: type, name: str) -> str:
    """What torch.optim's twin of ``cls`` calls the argument ``name`` (Markdown)."""
    import inspect

    twin = cls.spec.torch
    for alias in twin.aliases:
        if alias.ours == (name,):
            return f"`{alias.torch}`"
        if name in alias.ours:
            return f"`{alias.torch}[{alias.ours.index(name)}]`"
    if name in twin.nearest:
        reasons = [reason for key, _, reason in twin.exact_when if key == name]
        return f"`{twin.nearest[name]}`, not equal: {reasons[0]}" if reasons else f"`{twin.nearest[name]}`"
    if twin.class_name is None:
        return "none"
    return f"`{name}`" if name in inspect.signature(twin.torch_class).parameters else "none"


def _meanings(cls: type, class_name: str) -> dict[str, str]:
    """Argument -> its meaning: the docstring's ``Args:``, else the spec's hyperparameter (with its range), else
    the hyperparameters a torch name stands for, else :data:`_TORCH_FLAGS`."""
    target = load_package()[class_name]
    target = target.final_target if target.is_alias else target
    spec = {h.name: f"{h.doc}; {h.describe_range()}" for h in cls.spec.hyperparameters}
    meanings = dict(_TORCH_FLAGS)
    meanings.update(spec)
    for alias in cls.spec.torch.aliases:
        if alias.torch not in spec:
            ours = ", ".join(f"`{n}`" for n in alias.ours)
            meanings[alias.torch] = f"torch's name for {ours}" if len(alias.ours) == 1 or alias.torch != "betas" \
                else f"({ours}): " + "; ".join(spec[n] for n in alias.ours)
    for section in target.docstring.parse("google", warn_missing_types=False, warn_unknown_params=False):
        if section.kind is griffe.DocstringSectionKind.parameters:
            meanings.update((p.name.lstrip("*"), " ".join(p.description.split())) for p in section.value)
    return meanings


def arguments_markdown(class_name: str) -> str:
    """The table of ``dml_optim.<class_name>``'s constructor arguments, from its signature, docstring and spec."""
    import inspect

    import dml_optim

    cls = getattr(dml_optim, class_name)
    meanings = _meanings(cls, class_name)
    twin = f"`torch.optim.{cls.spec.torch.class_name}`" if cls.spec.torch.exists else "torch.optim (no twin)"
    lines = [f"| argument | default | meaning | name in {twin} |", "|---|---|---|---|"]
    for param in inspect.signature(cls).parameters.values():
        if param.kind is param.VAR_KEYWORD:
            lines.append(f"| `**{param.name}` | | the options every optimizer takes: see [Options](../guide/options.md) | |")
            continue
        default = "" if param.default is param.empty else f"`{param.default!r}`"
        meaning = "parameters or param-group dicts" if param.name == "params" else meanings.get(param.name, "")
        torch_name = "`params`" if param.name == "params" else _torch_name(cls, param.name)
        lines.append(f"| `{param.name}` | {default} | {meaning} | {torch_name} |")
    return "\n".join(lines)


_GENERATED = {"cli": cli_markdown, "api": api_markdown}


def on_config(config: Any) -> Any:
    """Fail the strict build on a public name without a docstring (and on a stale :data:`KNOWN_MISSING`)."""
    missing = missing_docstrings()
    for name in missing:
        if name not in KNOWN_MISSING:
            log.warning(f"dml_optim.{name} is public (dml_optim.__all__) and has no docstring")
    for name in set(KNOWN_MISSING) - set(missing):
        log.warning(f"dml_optim.{name} has a docstring now: remove it from KNOWN_MISSING in tools/docs_hooks.py")
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Put the generated parts in place of their ``<!-- GENERATED: NAME -->`` markers."""
    for name, make in _GENERATED.items():
        marker = f"<!-- GENERATED: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return re.sub(r"<!-- GENERATED: arguments (\w+) -->", lambda m: arguments_markdown(m.group(1)), markdown)
