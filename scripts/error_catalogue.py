"""Generate docs/errors.md, the catalogue of every error message a user can meet, from the sources.

docs/api.md ("Errors") says what each kind of error means and what to do; this is the list of every message
itself. A hand-kept list drifts as soon as a check is added or reworded, so this script reads the messages out
of the code instead:

- Python (uccl_ep_train/, megatron_patch/): every `raise E(message)` whose E is a builtin error, an error
  class of the package (its name ends in "Error") or SystemExit with a message (the CLI's way to stop);
- C++ (csrc/): every message of the throwing macros of csrc/common/check.h (UCCL_CHECK, UCCL_THROW and the
  checked-call macros, expanded from their definitions), every direct `throw E(...)`, and the sentences
  csrc/common/errors.cpp makes of the kernels' error records (describe_error), code by code and phase by phase.

A message becomes a template: its fixed words as written, everything computed at run time as `{expression}`.

    python scripts/error_catalogue.py          # writes docs/errors.md
    python scripts/error_catalogue.py --check  # exit 1 with a diff when docs/errors.md is out of date
"""
from __future__ import annotations

import ast
import bisect
import difflib
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = Path("docs/errors.md")
PY_PACKAGES = ("uccl_ep_train", "megatron_patch")
CPP_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")
CHECK_HEADER = Path("csrc/common/check.h")
RECORD_SOURCE = Path("csrc/common/errors.cpp")

# Exceptions whose message is meant for the user; package classes are recognised by their name ("...Error").
PY_ERRORS = {"ValueError", "TypeError", "RuntimeError", "NotImplementedError", "TimeoutError", "KeyError",
             "IndexError", "RankLocalError", "CommTimeoutError"}
PY_EXITS = {"SystemExit"}  # the CLI stops with a message this way; argparse prints it like an error
MACRO_KIND = "C++ (RuntimeError in Python)"
RECORD_KIND = "kernel error record (RuntimeError)"
# How pybind11 translates what the native module throws directly.
CPP_THROWS = {"std::invalid_argument": "ValueError", "std::domain_error": "ValueError",
              "std::length_error": "ValueError", "std::out_of_range": "IndexError",
              "std::runtime_error": "RuntimeError", "std::logic_error": "RuntimeError",
              "py::value_error": "ValueError", "py::index_error": "IndexError", "py::type_error": "TypeError",
              "py::key_error": "KeyError", "py::stop_iteration": "StopIteration"}
LONGEST_PLACEHOLDER = 60  # longer expressions become {...}: the fixed words matter, not the code

# (key, title, what it covers), in the document's order.
AREAS = (
    ("buffer", "Buffer and validation",
     "The library's front: `Buffer`, argument and value checks, configuration, topology, GPU sharing, the "
     "autograd functions and the `deep_ep` / ElasticBuffer drop-ins."),
    ("backends", "Backends (intranode, internode, low latency, reference)",
     "The backends behind `Buffer` (uccl_ep_train/backends/) and the native kernels' host-side checks "
     "(csrc/kernels/, csrc/bindings.cpp)."),
    ("proxies", "Proxies and transports",
     "The CPU proxies and their transports (ipc, verbs, fabric), their NIC choice and fault injection: "
     "uccl_ep_train/proxy.py, uccl_ep_train/nics.py, csrc/proxy/, csrc/transport/."),
    ("records", "Kernels' error records",
     "What a kernel found on the GPU (a timeout, a buffer too small, a bad value) travels as a record (code, "
     "rank, peer, block, phase, need, have); `describe_error` in csrc/common/errors.cpp makes it a sentence, "
     "which the Buffer raises as RuntimeError. Each code's wording is listed with its fragments in order "
     "(` … ` separates fragments that are written on conditions), then each phase's label and what a "
     "peer did not do (`{peer}`), which the timeout sentence quotes."),
    ("megatron", "Megatron and Primus integration",
     "The `uccl` token dispatcher, its settings and budget, the Primus patches (megatron_patch/, "
     "uccl_ep_train/compat/primus_turbo.py)."),
    ("apps", "Applications and CLI",
     "`uccl-ep-train` and its commands (uccl_ep_train/apps/): launch, train, plan, doctor, bench, mps."),
)


@dataclass(frozen=True)
class Entry:
    """One message: where it is raised and what it says. `via` names the helper that words it, if any."""
    path: str  # relative to the repository root
    line: int
    where: str  # enclosing function, Class.method, or what the record wording belongs to
    kind: str
    template: str
    via: str = ""  # the helper's name, when a call of it words the message
    via_at: str = ""  # the file that defines the helper

    @property
    def area(self) -> str:
        return area_of(self.path)

    @property
    def forwarded(self) -> bool:
        """A message made elsewhere (a peer's, the native module's, a caught exception's): no fixed words."""
        return re.fullmatch(r"\{[^{}]*\}", self.template) is not None


def area_of(path: str) -> str:
    """The document section of a source file; the layers of the README's layout, kernels' records apart."""
    if path.startswith("uccl_ep_train/apps/"):
        return "apps"
    if path.startswith("megatron_patch/") or path == "uccl_ep_train/compat/primus_turbo.py":
        return "megatron"
    if path in ("uccl_ep_train/proxy.py", "uccl_ep_train/nics.py") or path.startswith(
            ("csrc/proxy/", "csrc/transport/")):
        return "proxies"
    if path.startswith(("uccl_ep_train/backends/", "csrc/kernels/")) or path == "csrc/bindings.cpp":
        return "backends"
    if path.startswith("csrc/common/errors"):
        return "records"
    return "buffer"


def squash(text: str) -> str:
    """One line, single spaces: a message's code spread over lines reads as the expression it is."""
    return " ".join(text.split())


def placeholder(expr: str) -> str:
    """`{expr}` for a value computed at run time; long expressions shortened, their code is not the message."""
    expr = squash(expr)
    return "{" + (expr if len(expr) <= LONGEST_PLACEHOLDER else "...") + "}"


# ---------------------------------------------------------------------------------------------------------
# Python


@dataclass
class PyModule:
    """A parsed package module and the names a message may borrow from it."""
    path: str
    source: str
    tree: ast.Module
    constants: dict[str, ast.expr]  # module-level string constants, inlined: the user reads their words
    imported: set[str]  # names bound by imports (a constant may live in another module, a helper in one)


def is_text(node: ast.expr) -> bool:
    """Whether an expression evidently builds a string: only those are rendered as templates."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return is_text(node.left) or is_text(node.right)
    if isinstance(node, ast.IfExp):
        return is_text(node.body) and is_text(node.orelse)
    return False


def module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level names bound once to a string (a literal, an f-string); a name bound twice is no constant."""
    seen: dict[str, int] = {}
    values: dict[str, ast.expr] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name, value = stmt.targets[0].id, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            name, value = stmt.target.id, stmt.value
        else:
            continue
        seen[name] = seen.get(name, 0) + 1
        if is_text(value):
            values[name] = value
    return {name: text for name, text in values.items() if seen[name] == 1}


def load_modules(root: Path) -> list[PyModule]:
    """Every module of the packages, by path: the order of the document."""
    modules = []
    for package in PY_PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            source = file.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=str(file))
            imported = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                        if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
            modules.append(PyModule(file.relative_to(root).as_posix(), source, tree, module_constants(tree),
                                    imported))
    return modules


class PyCatalogue:
    """The Python side's messages: raise sites, rendered with the package's constants and helpers."""

    def __init__(self, modules: list[PyModule]):
        self.modules = modules
        self.functions: dict[str, list[tuple[PyModule, ast.FunctionDef | ast.AsyncFunctionDef]]] = {}
        self.bases: dict[str, str] = {}
        for module in modules:
            for node in ast.walk(module.tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.setdefault(node.name, []).append((module, node))
                elif isinstance(node, ast.ClassDef) and node.bases:
                    self.bases[node.name] = ast.unparse(node.bases[0])

    def constant(self, module: PyModule, name: str) -> str | None:
        """A string constant `name` as `module` sees it (its own, or the one module that defines an import),
        rendered where it is defined."""
        if name in module.constants:
            return self.render(module, module.constants[name])
        if name in module.imported:
            found = [m for m in self.modules if name in m.constants]
            if len(found) == 1:
                return self.render(found[0], found[0].constants[name])
        return None

    def render(self, module: PyModule, node: ast.expr) -> str:
        """A string expression as a template: literals as written, computed parts as {source}."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(self.render_part(module, part) for part in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and is_text(node):
            return self.render(module, node.left) + self.render(module, node.right)
        if isinstance(node, ast.Name) and (text := self.constant(module, node.id)) is not None:
            return text
        return placeholder(self.source(module, node))

    def render_part(self, module: PyModule, part: ast.expr) -> str:
        """One piece of an f-string: text, an inlined constant, or {expr!conversion:spec}."""
        if not isinstance(part, ast.FormattedValue):
            return self.render(module, part)
        if part.conversion == -1 and part.format_spec is None and isinstance(part.value, ast.Name):
            text = self.constant(module, part.value.id)
            if text is not None:
                return text
        expr = squash(self.source(module, part.value))
        if len(expr) > LONGEST_PLACEHOLDER:
            return "{...}"
        conversion = "!" + chr(part.conversion) if part.conversion != -1 else ""
        spec = ":" + self.render(module, part.format_spec) if part.format_spec is not None else ""
        return "{" + expr + conversion + spec + "}"

    @staticmethod
    def source(module: PyModule, node: ast.AST) -> str:
        """The expression as written (ast.unparse where positions are missing)."""
        return ast.get_source_segment(module.source, node) or ast.unparse(node)

    def helper(self, module: PyModule, call: ast.Call) -> tuple[PyModule, ast.FunctionDef] | None:
        """The package function a message-building call names (`f(...)`, `module.f(...)`, `self.f(...)`): the
        caller's module's own, else the one definition in the package; None for anything else (a str method,
        a method of another object, an ambiguous name), whose result is then shown as {call}."""
        func = call.func
        if isinstance(func, ast.Name):
            name, anywhere = func.id, True
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and (
                func.value.id == "self" or func.value.id in module.imported):
            name, anywhere = func.attr, func.value.id != "self"
        else:
            return None
        candidates = self.functions.get(name, [])
        chosen = [c for c in candidates if c[0] is module] or (candidates if anywhere else [])
        return chosen[0] if len(chosen) == 1 else None

    def messages(self, module: PyModule, scope: ast.AST, raise_node: ast.Raise, arg: ast.expr
                 ) -> list[tuple[str, str, str]]:
        """(template, helper, helper's place) for each message a raise can carry: both branches of a
        conditional, the f-strings a helper returns (one level), the string a local variable was last given
        before the raise."""
        if isinstance(arg, ast.IfExp):
            return (self.messages(module, scope, raise_node, arg.body)
                    + self.messages(module, scope, raise_node, arg.orelse))
        if isinstance(arg, ast.Call) and (found := self.helper(module, arg)) is not None:
            helper_module, func = found
            returns = [node.value for node in ast.walk(func)
                       if isinstance(node, ast.Return) and node.value is not None and is_text(node.value)]
            if returns:
                via = (f"{func.name}()", helper_module.path)
                return [(self.render(helper_module, value), *via) for value in returns]
        if isinstance(arg, ast.Name) and arg.id not in module.constants:
            value = last_assignment(scope, arg.id, raise_node.lineno)
            if value is not None and is_text(value):
                return self.messages(module, scope, raise_node, value)
        return [(self.render(module, arg), "", "")]

    def kind(self, name: str) -> str:
        """The exception's name, with its base for the package's own classes (what a caller catches)."""
        base = self.bases.get(name)
        return f"{name} ({base})" if base else name

    def entries(self) -> list[Entry]:
        """Every user-facing raise of the packages."""
        found: list[Entry] = []
        for module in self.modules:
            for scope, names, node in raises(module.tree):
                call = node.exc
                assert isinstance(call, ast.Call)
                name = ast.unparse(call.func)
                if not user_facing(name, call):
                    continue
                where = ".".join(names) or "(module)"
                if not call.args:
                    found.append(Entry(module.path, node.lineno, where, self.kind(name), "(no message)"))
                    continue
                for template, via, via_at in self.messages(module, scope, node, call.args[0]):
                    found.append(Entry(module.path, node.lineno, where, self.kind(name), template, via, via_at))
        return found


def user_facing(name: str, call: ast.Call) -> bool:
    """Errors by name (builtin or the package's "...Error"); SystemExit only with a message, not a code."""
    if name in PY_ERRORS or name.rsplit(".", 1)[-1].endswith("Error"):
        return True
    return name in PY_EXITS and bool(call.args) and (is_text(call.args[0]) or isinstance(call.args[0], ast.Name))


def last_assignment(scope: ast.AST, name: str, before: int) -> ast.expr | None:
    """The value `name` was last bound to in `scope` above line `before` (a message built in a variable)."""
    best: tuple[int, ast.expr] | None = None
    for node in ast.walk(scope):
        if (isinstance(node, ast.Assign) and node.lineno < before
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            if best is None or node.lineno > best[0]:
                best = (node.lineno, node.value)
    return best[1] if best else None


def raises(tree: ast.Module):
    """(enclosing scope node, its qualified name parts, raise) for each `raise E(...)`: bare re-raises and
    `raise exc` pass on an exception made elsewhere, so they carry no message of their own."""
    stack: list[tuple[ast.AST, str]] = []

    def visit(node: ast.AST):
        named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if named:
            stack.append((node, node.name))
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            scope = next((n for n, _ in reversed(stack) if not isinstance(n, ast.ClassDef)), tree)
            yield scope, [name for _, name in stack], node
        for child in ast.iter_child_nodes(node):
            yield from visit(child)
        if named:
            stack.pop()

    yield from visit(tree)


# ---------------------------------------------------------------------------------------------------------
# C++: text handling

STRING_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"' + r"|'(?:[^'\\\n]|\\.)*'")
ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", "0": "\0", "r": "\r"}
OPEN, CLOSE = "([{", ")]}"


def strip_comments(text: str) -> str:
    """Comments become spaces (newlines kept, so offsets and line numbers stay), strings are left alone."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            m = STRING_RE.match(text, i)
            end = m.end() if m else i + 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
            continue
        else:
            end = i + 1
        out.append(text[i:end])
        i = end
    return "".join(out)


def blank_strings(text: str) -> str:
    """String and character literals' contents become spaces: brackets and keywords inside them are text."""
    return STRING_RE.sub(lambda m: m.group(0)[0] + " " * (len(m.group(0)) - 2) + m.group(0)[-1], text)


def blank_preprocessor(text: str) -> str:
    """Directives (with their continuation lines) become spaces: a macro's definition is no call of it."""
    return re.sub(r"(?m)^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def unescape(literal: str) -> str:
    """A C++ string or character literal's contents as the user reads them."""
    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m.group(1), "\\" + m.group(1)), literal[1:-1])


def matching(blanked: str, open_at: int) -> int | None:
    """The index of the bracket closing the one at `open_at` (in string-blanked text), None if unbalanced."""
    depth = 0
    for i in range(open_at, len(blanked)):
        c = blanked[i]
        if c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
            if depth == 0:
                return i
    return None


def split_top(text: str, separator: str) -> list[str]:
    """`text` cut at `separator` where it stands outside brackets and strings (`<<` of a stream, `+` of a
    concatenation, `,` of an argument list); `++`, `+=` and `<<=` are no separators."""
    blanked = blank_strings(text)
    parts, depth, start, i = [], 0, 0, 0
    while i < len(blanked):
        c = blanked[i]
        if c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
        elif depth == 0 and blanked.startswith(separator, i):
            after = blanked[i + len(separator):i + len(separator) + 1]
            if (separator == "+" and (after in ("+", "=") or blanked[i - 1:i] == "+")) or (
                    separator == "<<" and after == "="):
                i += len(separator)
                continue
            parts.append(text[start:i])
            start = i + len(separator)
            i = start
            continue
        i += 1
    parts.append(text[start:])
    return parts


def unwrap(operand: str) -> str:
    """`std::to_string(x)` -> `x` and `std::string("...")` -> `"..."`: the conversion is not the message."""
    m = re.match(r"std::(string|to_string)\s*\(", operand)
    if m and matching(blank_strings(operand), m.end() - 1) == len(operand) - 1:
        inner = operand[m.end():-1].strip()
        if m.group(1) == "to_string" or STRING_RE.fullmatch(inner):
            return inner
    return operand


def ternary(operand: str) -> tuple[str, str] | None:
    """The two branches of `(cond ? a : b)` (parentheses optional), None for any other operand."""
    while operand.startswith("(") and matching(blank_strings(operand), 0) == len(operand) - 1:
        operand = operand[1:-1].strip()
    blanked, depth, question = blank_strings(operand), 0, None
    for i, c in enumerate(blanked):
        if c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
        elif depth == 0 and c == "?" and question is None:
            question = i
        elif depth == 0 and c == ":" and question is not None and ":" not in (blanked[i - 1], blanked[i + 1:i + 2]):
            return operand[question + 1:i].strip(), operand[i + 1:].strip()
    return None


def render_operand(operand: str) -> str:
    """One operand of a message: adjacent literals joined as written, a choice between texts as
    {"one" | "other"}, anything else {expression}."""
    operand = unwrap(operand.strip())
    branches = ternary(operand)
    if branches and any(STRING_RE.search(branch) for branch in branches):
        shown = [f'"{render_stream(b, "+")}"' if STRING_RE.search(b) else squash(b) for b in branches]
        return "{" + " | ".join(shown) + "}"
    literals = STRING_RE.findall(operand)
    if literals and STRING_RE.sub("", operand).strip() == "":
        return "".join(unescape(lit) for lit in literals)
    return placeholder(operand)


def render_stream(text: str, separator: str = "<<") -> str:
    """A `<<`-joined stream (or a `+`-joined concatenation) as a template."""
    return "".join(render_operand(part) for part in split_top(text, separator) if part.strip())


def call_args(text: str, blanked: str, open_at: int) -> list[str] | None:
    """The top-level arguments of the call whose `(` is at `open_at`; None when it is not closed."""
    close = matching(blanked, open_at)
    if close is None:
        return None
    return [a.strip() for a in split_top(text[open_at + 1:close], ",")]


class LineIndex:
    """Offsets to 1-based line numbers."""

    def __init__(self, text: str):
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def line(self, offset: int) -> int:
        return bisect.bisect_right(self.starts, offset)


# ---------------------------------------------------------------------------------------------------------
# C++: enclosing functions


@dataclass
class Block:
    """A `{...}` of a source file and what it opens: a function (`name`), class, namespace, lambda, other."""
    start: int
    end: int
    kind: str
    name: str
    header: str


CALL_HEADER = re.compile(r"\)\s*(?:(?:const|noexcept|override|final|mutable|volatile|&)\s*)*"
                         r"(?:->\s*[\w:<>,\s*&]+)?$")
CONTROL = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype"}


def cut_initialisers(header: str) -> str:
    """A constructor's header without its member initialiser list (`Foo(int a) : a_(a)` -> `Foo(int a)`)."""
    depth = 0
    for i, c in enumerate(header):
        if c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
            rest = header[i + 1:].lstrip()
            if depth == 0 and c == ")" and rest.startswith(":") and not rest.startswith("::"):
                return header[:i + 1]
    return header


def classify(header: str) -> tuple[str, str]:
    """(kind, name) of the block a `{` opens, from the code before it (strings blanked)."""
    text = squash(header)
    if not text or re.search(r"(?:^|\W)(?:else|do|try)$", text) or text.endswith((":", '"')):
        return "block", ""
    if m := re.search(r"\bnamespace\b\s*([\w:]*)", text):
        return "namespace", m.group(1)
    if m := re.search(r"\b(?:class|struct|union|enum)\s+(?:class\s+|struct\s+)?(\w+)", text):
        if not text.endswith(")"):
            return "class", m.group(1)
    text = cut_initialisers(text)
    m = CALL_HEADER.search(text)
    if m is None:
        return ("init", "") if re.search(r"[\w>=,(\[]$", text) else ("block", "")
    open_at = find_open(text, m.start())
    if open_at is None:
        return "block", ""
    before = text[:open_at].rstrip()
    if before.endswith("]") or not before:
        return "lambda", ""
    name = re.search(r"((?:[\w~]+\s*::\s*)*(?:operator\s*\S+?|~?\w+))\s*(?:<[^()]*>)?$", before)
    if name is None or name.group(1) in CONTROL:
        return "block", ""
    return "function", name.group(1).replace(" ", "")


def find_open(text: str, close_at: int) -> int | None:
    """The `(` matching the `)` at `close_at`, scanning backwards."""
    depth = 0
    for i in range(close_at, -1, -1):
        if text[i] in CLOSE:
            depth += 1
        elif text[i] in OPEN:
            depth -= 1
            if depth == 0:
                return i
    return None


def blocks(blanked: str) -> list[Block]:
    """Every brace block of a file (strings, comments and directives blanked), with what it opens; a
    brace initialiser does not end the statement around it, so the next block's header starts before it."""
    found: list[Block] = []
    stack: list[tuple[int, str, str, str, int, int]] = []  # start, kind, name, header, boundary, depth
    boundary, depth = 0, 0
    for i, c in enumerate(blanked):
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == ";" and depth <= 0:
            boundary = i + 1
        elif c == "{":
            header = blanked[boundary:i]
            kind, name = classify(header)
            stack.append((i, kind, name, header, boundary, depth))
            boundary, depth = i + 1, 0
        elif c == "}" and stack:
            start, kind, name, header, outer_boundary, outer_depth = stack.pop()
            found.append(Block(start, i, kind, name, header))
            depth = outer_depth
            boundary = outer_boundary if kind == "init" else i + 1
    return found


def enclosing(found: list[Block], source: str, offset: int) -> str:
    """`Class::function` (or `function (lambda .def("name"))`) around `offset`; "(file scope)" outside any."""
    around = sorted((b for b in found if b.start < offset < b.end), key=lambda b: b.start)
    name, classes, lambda_label = "", [], ""
    for block in around:
        if block.kind == "class":
            classes.append(block.name)
        elif block.kind == "function":
            name, lambda_label = block.name, ""
            if "::" not in name and classes:
                name = "::".join(classes + [name])
        elif block.kind == "lambda":
            header_source = source[block.start - len(block.header):block.start]
            bound = re.findall(r'\.def\w*\(\s*"(\w+)"', header_source)
            lambda_label = f' (lambda .def("{bound[-1]}"))' if bound else " (lambda)"
    return (name or "(file scope)") + lambda_label


# ---------------------------------------------------------------------------------------------------------
# C++: the throwing macros and throws


@dataclass
class Macro:
    """A throwing macro of check.h: its parameters, and either the parameter it streams into the exception
    (the base macro) or the throwing macro call its body makes."""
    name: str
    params: list[str]
    streamed: str  # the base macro's message parameter, "" for the others
    inner: str  # the body, which calls another throwing macro; "" for the base


def read_macros(root: Path) -> dict[str, Macro]:
    """The throwing macros check.h defines: the one that throws (it streams a parameter into throw_error)
    and every macro whose body calls a throwing one."""
    text = strip_comments((root / CHECK_HEADER).read_text(encoding="utf-8"))
    defined = {}
    for m in re.finditer(r"(?m)^[ \t]*#define[ \t]+(\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", text):
        defined[m.group(1)] = ([p.strip() for p in m.group(2).split(",")], m.group(3).replace("\\\n", " "))
    macros: dict[str, Macro] = {}
    for name, (params, body) in defined.items():
        if "throw_error" in body and (m := re.search(r"<<\s*(\w+)\s*;", body)):
            macros[name] = Macro(name, params, m.group(1), "")
    grew = True
    while grew:  # a macro is throwing if it calls one that is
        grew = False
        for name, (params, body) in defined.items():
            if name not in macros and any(re.search(rf"\b{re.escape(n)}\s*\(", body) for n in macros):
                macros[name] = Macro(name, params, "", body)
                grew = True
    return macros


def substitute(body: str, params: list[str], args: list[str]) -> str:
    """A macro body with its arguments: `#param` stringified as the preprocessor does, `param` replaced;
    string literals of the body are left as they are."""
    values = dict(zip(params, args))

    def stringified(value: str) -> str:
        return '"' + squash(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

    def replace(m: re.Match) -> str:
        if m.group(1) in values:
            return stringified(values[m.group(1)])
        return values.get(m.group(2), m.group(0)) if m.group(2) else m.group(0)

    def in_code(code: str) -> str:  # one pass: what was put in is not substituted again
        return re.sub(r"#\s*(\w+)|\b(\w+)\b", replace, code)

    pieces, last = [], 0
    for m in STRING_RE.finditer(body):
        pieces.append(in_code(body[last:m.start()]))
        pieces.append(m.group(0))
        last = m.end()
    pieces.append(in_code(body[last:]))
    return "".join(pieces)


def expand(macros: dict[str, Macro], name: str, args: list[str]) -> str | None:
    """The message stream a throwing macro call throws, in terms of its arguments; None if it cannot be
    followed (wrong argument count, an inner call that does not parse)."""
    macro = macros[name]
    if len(args) != len(macro.params):
        return None
    if macro.streamed:
        return args[macro.params.index(macro.streamed)]
    body = substitute(macro.inner, macro.params, args)
    blanked = blank_strings(body)
    for m in re.finditer(r"\b(\w+)\s*\(", blanked):
        if m.group(1) in macros:
            parsed = call_args(body, blanked, m.end() - 1)
            return None if parsed is None else expand(macros, m.group(1), parsed)
    return None


def cpp_files(root: Path) -> list[Path]:
    """The native sources, by path; check.h itself only defines the macros."""
    return sorted(p for p in (root / "csrc").rglob("*") if p.suffix in CPP_SUFFIXES and p.is_file()
                  and p.relative_to(root) != CHECK_HEADER)


def cpp_entries(root: Path, macros: dict[str, Macro]) -> tuple[list[Entry], list[str]]:
    """The messages of every throwing macro call and `throw E(...)` of csrc/, and the calls that did not
    parse (as `path:line`)."""
    entries, failed = [], []
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(macros))) + r")\s*\(|\bthrow\s+([\w:]+)\s*\(")
    for file in cpp_files(root):
        path = file.relative_to(root).as_posix()
        text = blank_preprocessor(strip_comments(file.read_text(encoding="utf-8")))
        blanked = blank_strings(text)
        lines, scopes = LineIndex(text), blocks(blanked)
        for m in pattern.finditer(blanked):
            parsed = call_args(text, blanked, m.end() - 1)
            where = enclosing(scopes, text, m.start())
            if m.group(1):
                stream = expand(macros, m.group(1), parsed) if parsed else None
                kind, template = MACRO_KIND, render_stream(stream) if stream is not None else None
            else:
                thrown = m.group(2)
                kind = f"C++ {thrown} ({CPP_THROWS.get(thrown, 'RuntimeError')} in Python)"
                template = render_stream(parsed[0], "+") if parsed and parsed != [""] else None
            if template is None:
                failed.append(f"{path}:{lines.line(m.start())}")
                continue
            entries.append(Entry(path, lines.line(m.start()), where, kind, template))
    return entries, failed


# ---------------------------------------------------------------------------------------------------------
# C++: the kernels' error records (describe_error)


def statements(body: str, start: int, end: int, pattern: str) -> list[tuple[int, str]]:
    """(offset, text) of each statement in body[start:end] that begins with `pattern`, up to its `;`."""
    blanked = blank_strings(body)
    found = []
    for m in re.finditer(pattern, blanked[start:end]):
        at = start + m.start()
        depth = 0
        for i in range(at, end):
            if blanked[i] in OPEN:
                depth += 1
            elif blanked[i] in CLOSE:
                depth -= 1
            elif blanked[i] == ";" and depth == 0:
                found.append((at, body[at:i]))
                break
    return found


def fragments(text: str, block: Block, functions: dict[str, Block]) -> list[str]:
    """What a function writes into `os` (in order) or returns as literals: the words of a sentence. A
    statement that only streams another wording function's result (or passes `os` to one) takes its words."""
    found = (statements(text, block.start, block.end, r"\bos\s*<<|\b\w+\s*\(\s*os\s*,")
             + statements(text, block.start, block.end, r"\breturn\s+\""))
    words: list[str] = []
    for _, stmt in sorted(found):
        if stmt.startswith("return"):
            words.append(render_operand(stmt[len("return"):]))
            continue
        operands = split_top(stmt.split("<<", 1)[1], "<<") if stmt.startswith("os") else [stmt]
        called = re.match(r"\s*(\w+)\s*\(", operands[0])
        if len(operands) == 1 and called and called.group(1) in functions:
            words.extend(fragments(text, functions[called.group(1)], functions))
        else:
            words.append(render_stream("<<".join(operands)))
    return [w.strip() for w in words if w.strip()]


def record_entries(root: Path) -> list[Entry]:
    """Each error code's sentence (describe_error's cases, the helpers they call inlined), what every
    sentence may end with, each phase's label and wording, and the helpers that word parts of sentences."""
    file = root / RECORD_SOURCE
    path = RECORD_SOURCE.as_posix()
    text = blank_preprocessor(strip_comments(file.read_text(encoding="utf-8")))
    blanked = blank_strings(text)
    lines, scopes = LineIndex(text), blocks(blanked)
    functions = {b.name: b for b in scopes if b.kind == "function"}
    entries: list[Entry] = []
    describe = functions["describe_error"]
    switch = next(b for b in scopes if b.kind == "block" and "switch" in b.header
                  and describe.start < b.start < describe.end)
    labels = list(re.finditer(r"\bcase\s+(\w+)\s*:|\bdefault\s*:", blanked[switch.start:switch.end]))
    for label, following in zip(labels, labels[1:] + [None]):
        start = switch.start + label.end()
        end = switch.start + following.start() if following else switch.end
        parts = fragments(text, Block(start, end, "block", "", ""), functions)
        code = label.group(1) or "default (unknown code)"
        entries.append(Entry(path, lines.line(switch.start + label.start()), f"describe_error: {code}",
                             RECORD_KIND, " … ".join(parts)))
    tail = Block(switch.end, describe.end, "block", "", "")
    entries.append(Entry(path, lines.line(switch.end), "describe_error: every code (end)", RECORD_KIND,
                         " … ".join(fragments(text, tail, functions))))
    phase = re.compile(r'\{\s*([\w:]+)\s*,\s*("(?:[^"\\]|\\.)*")\s*,\s*("(?:[^"\\]|\\.)*")\s*,'
                       r'\s*("(?:[^"\\]|\\.)*")\s*\}')
    for m in phase.finditer(text):
        name = m.group(1) if m.group(1) != "0" else "(unknown)"
        op, label_text, what = (unescape(m.group(i)) for i in (2, 3, 4))
        entries.append(Entry(path, lines.line(m.start()), f"phase {name}, call '{op}'", RECORD_KIND,
                             f"'{label_text}': {what.replace('%', '{peer}')}"))
    for name, block in sorted(functions.items(), key=lambda item: item[1].start):
        if name in ("describe_error", "timeout"):
            continue  # inlined above, into the codes that use them
        words = fragments(text, block, functions)
        if words:
            entries.append(Entry(path, lines.line(block.start), name, RECORD_KIND, " … ".join(words)))
    return entries


# ---------------------------------------------------------------------------------------------------------
# The document


def collect(root: Path = ROOT) -> tuple[list[Entry], list[str]]:
    """Every message of the sources, by file then line, and the C++ calls that did not parse."""
    python = PyCatalogue(load_modules(root)).entries()
    native, failed = cpp_entries(root, read_macros(root))
    records = record_entries(root)
    return sorted(python + native + records, key=lambda e: (e.path, e.line)), failed


def code_span(text: str) -> str:
    """`text` as inline code that survives a Markdown table: pipes escaped, newlines shown as \\n, a fence
    longer than any backtick run inside."""
    text = text.replace("\n", "\\n").replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or fence != "`" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def row(entry: Entry) -> str:
    """One table row: template, type, and where (file, function, helper that words it). No line numbers: the
    catalogue changes when a message or its home does, not with every edit above it."""
    where = f"`{entry.path}` {entry.where}"
    if entry.via:
        where += f", worded by `{entry.via}` in `{entry.via_at}`"
    where = where.replace("|", "\\|")
    return f"| {code_span(entry.template)} | {entry.kind} | {where} |"


INTRO = """\
# Error messages

Every error message a user of uccl-ep-train can meet, with its type and the place that raises it: the
Python library and integration (`raise`), the native module (`UCCL_CHECK` / `UCCL_THROW` and the checked-call
macros of csrc/common/check.h, direct `throw`s) and the sentences of the kernels' error records. What each
kind of error means and what to do in general: docs/api.md, "Errors"; tests/test_errors.py tests them.

This file is generated from the sources by `python scripts/error_catalogue.py` (do not edit it by hand;
`--check` tells whether it is up to date, and tests/test_error_catalogue.py fails when it is not).

How to read it: a message is shown as a template, its fixed words as they are written and every value
computed at run time as `{expression}` (`{...}` for long ones). To find yours, search this file for a few of
its fixed words, not for the numbers or names in it. A native message reaches Python as
`uccl_ep_train native: <message> (<file>:<line>)` from the checked macros (`UCCL_CHECK`'s message starts with
`check failed: <condition>: `). A template that is only `{...}` passes on a message made elsewhere (a peer's,
the native module's, a caught exception's): the words are those of the message it carries.
"""


def render(entries: list[Entry]) -> str:
    """The whole document: the introduction, a count per area, then one table per area."""
    out = [INTRO]
    by_area = {key: [e for e in entries if e.area == key] for key, _, _ in AREAS}
    out.append("| area | messages |\n|---|---|")
    for key, title, _ in AREAS:
        anchor = re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
        out.append(f"| [{title}](#{anchor}) | {len(by_area[key])} |")
    out.append("")
    for key, title, about in AREAS:
        out.append(f"## {title}\n\n{textwrap.fill(about, 110)}\n\n| message template | type | where |\n|---|---|---|")
        out.extend(row(entry) for entry in by_area[key])
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """Write docs/errors.md, or with --check tell whether it is up to date (exit 1 and a diff if not)."""
    check = "--check" in argv
    unknown = [a for a in argv if a != "--check"]
    if unknown:
        print(f"usage: python scripts/error_catalogue.py [--check] (got {' '.join(unknown)})", file=sys.stderr)
        return 2
    entries, failed = collect(ROOT)
    text = render(entries)
    target = ROOT / OUTPUT
    if check:
        current = target.read_text(encoding="utf-8") if target.exists() else ""
        if current == text:
            return 0
        diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(), f"{OUTPUT} (on disk)",
                                         f"{OUTPUT} (from the sources)", lineterm="", n=0))
        changed = sum(1 for d in diff if d[:1] in "+-" and not d.startswith(("+++", "---")))
        print("\n".join(diff[:60]) + ("\n..." if len(diff) > 60 else ""))
        print(f"{OUTPUT} is out of date ({changed} lines differ): run python scripts/error_catalogue.py")
        return 1
    target.write_text(text, encoding="utf-8")
    counts = ", ".join(f"{key} {sum(e.area == key for e in entries)}" for key, _, _ in AREAS)
    forwarded = sum(e.forwarded for e in entries)
    print(f"wrote {OUTPUT}: {len(entries)} messages ({counts}); {forwarded} forwarded (no fixed words)")
    if failed:
        print(f"could not parse {len(failed)} native calls: {', '.join(failed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
