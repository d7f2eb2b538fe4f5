"""Responders: the environment's side of a multi-turn episode.

When the agent's turn ends (EOS or a stop string), the env asks its responder for a reply: a tool result,
game feedback or a user's next message. The env formats the reply with the chat template and appends it to
the episode; those tokens are observations, not actions. Like rewards, responders are registered by name
(the ``register_responders`` hook, or ``@textgym.responder`` in a plain file) and always called with a batch:
every conversation whose agent turn ended on the same step.

A responder is anything with a ``name`` and ``__call__(conversations) -> replies``, one :class:`Reply` (or a
plain string) per :class:`Conversation`. It may also have ``role`` (the role of its replies in the chat
template, default ``"user"``), ``start(conversations) -> texts`` (called when episodes begin; a string is
appended to that episode's prompt, ``None`` keeps it), ``end(conversations)`` (called once when episodes are
over, whatever ended them: where per-episode resources are released) and ``close()``.

Environments written for other tools adapt into responders: :class:`TextEnvResponder` runs a text-level env
(``reset() -> text``, ``step(text) -> (text, reward, terminated, truncated, info)``, the shape of GEM's envs)
and :class:`ToolEnvResponder` a TRL ``environment_factory``-style class (``reset()``, public methods as tools,
optional ``get_reward()``). docs/environments.md is the user's guide.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from textgym.conversation import (
    Conversation,
    FunctionResponder,
    Reply,
    Responder,
    ResponderError,
)
from textgym.errors import ConfigError
from textgym.rewards import Turn

__all__ = [
    "Conversation",
    "FunctionResponder",
    "Reply",
    "Responder",
    "ResponderError",
    "TextEnvResponder",
    "ToolEnvResponder",
    "Turn",
    "make_responder",
    "responder",
]


# -- adapters ---------------------------------------------------------------------------------------------
def _call_reset(obj: Any, conversation: Conversation) -> Any:
    """``obj.reset(...)`` with the prompt's metadata keys that it takes (all of them for ``**kwargs``), as
    TRL passes a dataset row's columns, and the episode's seed when it takes a ``seed`` (and the metadata
    has none)."""
    meta = dict(conversation.meta)
    try:
        params = inspect.signature(obj.reset).parameters
    except (TypeError, ValueError):
        return obj.reset()
    if "seed" in params and "seed" not in meta and conversation.seed is not None:
        meta["seed"] = conversation.seed
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return obj.reset(**meta)
    return obj.reset(**{k: v for k, v in meta.items() if k in params})


def _end_envs(conversations: Sequence[Conversation]) -> None:
    """Close each episode's env instance (``state["env"]``) that has a ``close()``, once."""
    for c in conversations:
        env = c.state.pop("env", None)
        if callable(getattr(env, "close", None)):
            env.close()


class TextEnvResponder:
    """A text-level environment class (the shape of GEM's envs) as a responder.

    ``factory(**kwargs)`` is called once per episode, and the instance's ``close()`` (when it has one) when
    the episode is over. Its ``reset()`` (given the prompt's metadata keys it takes, and the episode's
    ``seed`` when it takes one) returns the first observation text, or ``(text, info)``, or None: the text is
    appended to the episode's prompt. Each agent turn is passed to ``step(text)``, which returns ``(text, reward, terminated,
    truncated, info)``: the text is the reply, the reward the turn's reward, and either flag ends the episode.

    Args:
        factory: the class (or any callable returning an instance).
        name: the responder's name in messages.
        role: the role of its replies in the chat template.
        **kwargs: passed to ``factory``.
    """

    def __init__(
        self, factory: Callable[..., Any], name: str | None = None, role: str = "user", **kwargs: Any
    ):
        if not callable(factory):
            raise ConfigError(f"text_env must be a class or a callable that returns an env, not {factory!r}.")
        self.factory, self.kwargs, self.role = factory, kwargs, role
        self.name = name or getattr(factory, "__name__", "text_env")
        _check_factory_arguments("text_env", self.name, factory, kwargs, ("name", "role"))

    def start(self, conversations: Sequence[Conversation]) -> list[str | None]:
        openings = []
        for c in conversations:
            env = c.state["env"] = self.factory(**self.kwargs)
            first = _call_reset(env, c)
            if isinstance(first, tuple) and first:
                first = first[0]  # GEM returns (observation, info)
            if first is not None and not isinstance(first, str):
                raise ResponderError(
                    f"responder {self.name!r}: reset() returned {type(first).__name__} {first!r}; it must return "
                    f"the first observation as a string, (string, info), or None."
                )
            openings.append(first or None)
        return openings

    def __call__(self, conversations: Sequence[Conversation]) -> list[Reply]:
        replies = []
        for c in conversations:
            result = c.state["env"].step(c.last)
            if not isinstance(result, tuple) or len(result) != 5:
                raise ResponderError(
                    f"responder {self.name!r}: step() returned {result!r}; it must return (text, reward, "
                    f"terminated, truncated, info)."
                )
            text, reward, terminated, truncated, _ = result
            done, cut = bool(terminated or truncated), bool(truncated and not terminated)
            replies.append(Reply(text, reward, done, truncated=cut))  # the env checks the reward
        return replies

    def end(self, conversations: Sequence[Conversation]) -> None:
        _end_envs(conversations)

    def close(self) -> None:
        pass


def _check_factory_arguments(
    kind: str, name: str, factory: Callable[..., Any], kwargs: Mapping[str, Any], own: Sequence[str]
) -> None:
    """The keys of a ``text_env``/``tool_env`` spec that go to its class are ones it takes: a misspelled
    ``tool_timout`` went to the class, which failed at the first reset ("takes no arguments")."""
    from textgym.factories import check_arguments

    check_arguments(f"responder {kind}", name, factory, kwargs, own)


TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
TOOL_FORMAT = '<tool_call>{"name": "TOOL", "arguments": {"ARG": VALUE}}</tool_call>'


class ToolEnvResponder:
    """A TRL ``environment_factory``-style class as a responder: its public methods are the tools.

    ``factory(**kwargs)`` is called once per episode, then its ``reset()`` (given the prompt's metadata keys it
    takes); a string it returns is appended to the prompt, after a list of the tools and the call format when
    ``describe_tools``. In each agent turn, every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    calls that method; the results (or error messages: an unknown tool, bad JSON, wrong arguments, an
    exception in the tool) are the reply, role ``"tool"``. A turn without a tool call is the final answer: the
    episode ends, and ``get_reward()``, when the class has it, is that turn's reward (also on the agent's
    last allowed turn). An episode that ends on the token budget (its answer cut, or a tool result that does
    not fit) gets no ``get_reward()`` call: the env's reward stack scores every completion, that one too.

    Args:
        factory: the class (or any callable returning an instance).
        name: the responder's name in messages.
        role: the role of its replies in the chat template.
        describe_tools: append the tool list and the call format to each prompt.
        tool_timeout: seconds a tool call may take (default: no limit). A call that takes longer is left
            running in a daemon thread, and its result is an error message the model reads ("did not return
            within"): a tool that hangs (a remote call, a deadlock) no longer stalls every episode of the step.
        **kwargs: passed to ``factory``.
    """

    def __init__(
        self,
        factory: Callable[..., Any],
        name: str | None = None,
        role: str = "tool",
        describe_tools: bool = True,
        tool_timeout: float | None = None,
        **kwargs: Any,
    ):
        if not callable(factory):
            raise ConfigError(f"tool_env must be a class or a callable that returns an env, not {factory!r}.")
        if tool_timeout is not None and (
            isinstance(tool_timeout, bool)
            or not isinstance(tool_timeout, (int, float))
            or not tool_timeout > 0
        ):
            raise ConfigError(f"tool_timeout must be a number of seconds > 0, not {tool_timeout!r}.")
        self.factory, self.kwargs, self.role, self.describe = factory, kwargs, role, describe_tools
        self.name = name or getattr(factory, "__name__", "tool_env")
        _check_factory_arguments(
            "tool_env", self.name, factory, kwargs, ("name", "role", "describe_tools", "tool_timeout")
        )
        self.tool_timeout = tool_timeout

    @staticmethod
    def tools(env: Any) -> dict[str, Callable[..., Any]]:
        """The public methods of ``env`` other than ``reset`` and ``get_reward``."""
        return {
            name: getattr(env, name)
            for name in dir(env)
            if not name.startswith("_")
            and name not in ("reset", "get_reward")
            and callable(getattr(env, name, None))
        }

    def describe_tools(self, env: Any) -> str:
        lines = ["Tools:"]
        for name, method in self.tools(env).items():
            doc = (inspect.getdoc(method) or "").split("\n\n")[0].replace("\n", " ")
            lines.append(f"- {name}{inspect.signature(method)}" + (f": {doc}" if doc else ""))
        lines.append(f"Call a tool by writing {TOOL_FORMAT}. Answer without a tool call when you are done.")
        return "\n".join(lines)

    def start(self, conversations: Sequence[Conversation]) -> list[str | None]:
        openings = []
        for c in conversations:
            env = c.state["env"] = self.factory(**self.kwargs)
            first = _call_reset(env, c)
            parts = [first] if isinstance(first, str) and first else []
            if self.describe:
                parts.append(self.describe_tools(env))
            openings.append("\n\n".join(parts) or None)
        return openings

    def __call__(self, conversations: Sequence[Conversation]) -> list[Reply]:
        replies = []
        for c in conversations:
            env = c.state["env"]
            calls = TOOL_CALL.findall(c.last)
            results = [self._call(env, body.strip(), closed) for body, closed in calls]
            done = not calls or c.last_turn
            reward = None
            if done and callable(getattr(env, "get_reward", None)):
                reward = float(env.get_reward())
            replies.append(Reply("\n".join(results), reward, done=not calls))
        return replies

    def _call(self, env: Any, body: str, closed: str) -> str:
        """One tool call's result, or an error message the model reads as the result."""
        if not closed:
            return "error: the tool call is not closed with </tool_call>."
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return f"error: the tool call is not valid JSON ({exc.msg}); write {TOOL_FORMAT}."
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return f'error: a tool call needs a "name"; write {TOOL_FORMAT}.'
        tools = self.tools(env)
        if call["name"] not in tools:
            return f"error: unknown tool {call['name']!r}; tools: {', '.join(tools) or '(none)'}."
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            return f'error: "arguments" must be an object, not {json.dumps(arguments)}.'
        try:
            inspect.signature(tools[call["name"]]).bind(**arguments)
        except TypeError as exc:
            return f"error: {call['name']}: {exc}."
        try:
            return str(self._run(tools[call["name"]], arguments, call["name"]))
        except Exception as exc:  # the tool's own failure is information for the model, as in TRL
            return f"error: {call['name']} raised {type(exc).__name__}: {exc}"

    def _run(self, tool: Callable[..., Any], arguments: dict[str, Any], name: str) -> Any:
        """``tool(**arguments)``, within ``tool_timeout`` when there is one."""
        if self.tool_timeout is None:
            return tool(**arguments)
        from textgym.reward_checks import call_within

        returned, out = call_within(lambda: tool(**arguments), self.tool_timeout, f"tool-{name}")
        return out if returned else f"error: {name} did not return within {self.tool_timeout:g} s."

    def end(self, conversations: Sequence[Conversation]) -> None:
        for c in conversations:  # (a public close() here is a tool, not called: only the instance goes)
            c.state.pop("env", None)


# -- building responders from specs -------------------------------------------------------------------------
ResponderSpec = str | Mapping[str, Any] | Responder | Callable[..., Any] | None


def make_responder(spec: ResponderSpec, base_dir: str | os.PathLike | None = None) -> Responder | None:
    """A responder from a spec, or None for none.

    A spec is a registered name (``"calculator"``, or ``"guess_number turn_penalty=0.2"``), a table
    ``{name = "guess_number", **kwargs}``, ``{text_env = "games.py:Wordle", **kwargs}`` (a
    :class:`TextEnvResponder`), ``{tool_env = "tools.py:Shop", **kwargs}`` (a :class:`ToolEnvResponder`), a
    responder object, or a plain function ``fn(conversations) -> replies``. ``base_dir`` resolves relative
    file paths (default: the current directory).
    """
    from textgym.factories import build_registered
    from textgym.rewards import parse_reward_spec

    if spec is None:
        return None
    if isinstance(spec, str):
        spec = parse_reward_spec(spec)
    if isinstance(spec, Mapping):
        args = dict(spec)
        adapters = {"text_env": TextEnvResponder, "tool_env": ToolEnvResponder}
        # next to an adapter's key, `name` is the adapter's name (in messages), not a registered responder
        given = [key for key in adapters if key in args] or [key for key in ("name",) if key in args]
        if len(given) != 1 or (given[0] == "name" and not isinstance(args["name"], str)):
            raise ConfigError(
                f"responder spec {dict(spec)!r} needs exactly one of 'name' (a registered responder), "
                f"'text_env' or 'tool_env' ('path/to/file.py:Class' or 'module:Class'; a 'name' next to "
                f"either names it)."
            )
        key = given[0]
        if key in adapters:
            return adapters[key](load_class(args.pop(key), base_dir, key), **args)
        return build_registered("responder", "register_responders", args.pop("name"), args, ResponderError)
    if isinstance(spec, type):  # called, it would build an instance, not reply
        cls = spec.__name__
        if hasattr(spec, "reset") and hasattr(spec, "step"):
            hint = f"a text env class is wrapped: TextEnvResponder({cls}), or {{text_env = 'file.py:{cls}'}}"
        elif hasattr(spec, "reset"):
            hint = f"a tool env class is wrapped: ToolEnvResponder({cls}), or {{tool_env = 'file.py:{cls}'}}"
        else:
            hint = f"pass an instance, {cls}(...)"
        raise ConfigError(f"responder {cls} is a class, not a responder: {hint}.")
    if callable(spec):
        if hasattr(spec, "name"):
            return spec  # type: ignore[return-value]
        parts = [part for part in ("role", "start", "end", "close") if hasattr(spec, part)]
        if parts:  # wrapped as a plain function, its role, opening and cleanup would be dropped unsaid
            raise ConfigError(
                f"responder {spec!r} has {', '.join(parts)} but no 'name': a responder object needs a name "
                f"(errors and logs use it). Give its class a `name` attribute."
            )
        return FunctionResponder(getattr(spec, "__name__", "responder"), spec)
    raise ConfigError(
        f"{spec!r} is not a responder spec: give a registered name, a table with 'name', 'text_env' or "
        f"'tool_env', a responder object, or a function."
    )


def load_class(ref: Any, base_dir: str | os.PathLike | None = None, key: str = "text_env") -> Any:
    """The class (or factory) named by ``"path/to/file.py:Class"`` or ``"module:Class"``. A file is loaded
    like a ``--plugin`` file, once per process; a relative path resolves against ``base_dir`` (default: the
    current directory)."""
    import importlib
    from pathlib import Path

    from textgym import plugin_manager
    from textgym.errors import PluginError

    form = "'path/to/file.py:Class' or 'module:Class'"
    target, _, attribute = ref.rpartition(":") if isinstance(ref, str) else ("", "", "")
    if not target or not attribute:
        raise ConfigError(f"responder {key} = {ref!r} must look like {form}.")
    try:
        if target.endswith(".py"):
            path = Path(target).expanduser()
            file = path if path.is_absolute() else Path(base_dir or Path.cwd()) / path
            module = plugin_manager.pm.get_plugin(plugin_manager.load_plugin_file(file))
        else:
            module = importlib.import_module(target)
    except (PluginError, ImportError) as exc:
        raise ConfigError(f"responder {key} = {ref!r}: cannot load {target!r}: {exc}") from None
    obj = getattr(module, attribute, None)
    if not callable(obj):
        classes = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and not n.startswith("_"))
        raise ConfigError(
            f"responder {key} = {ref!r}: {target!r} has no class {attribute!r}. Classes there: "
            f"{', '.join(classes) or '(none)'}."
        )
    return obj


def responder(name: str, role: str = "user") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a batched function as a responder plugin, for quick experiments in a plain file.

    Example::

        import textgym

        @textgym.responder("countdown", role="user")
        def countdown(conversations, start=3):
            return [textgym.Reply(str(start - c.agent_turns), done=c.agent_turns >= start)
                    for c in conversations]

    Extra keyword arguments of the function become the responder's arguments in a spec.
    """
    from textgym import plugin_manager

    plugin_manager.check_decorator_name(name, "@textgym.responder")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        plugin_manager.check_decorated(fn, "@textgym.responder", "register_responders")

        def factory(**kwargs: Any) -> FunctionResponder:
            return FunctionResponder(name, fn, role=role, **kwargs)

        # the arguments a spec may give: the function's own after `conversations`
        params = list(inspect.signature(fn).parameters.values())[1:]
        factory.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [
                p if p.kind is p.VAR_KEYWORD else p.replace(kind=p.KEYWORD_ONLY)
                for p in params
                if p.kind is not p.VAR_POSITIONAL
            ]
        )
        factory.__doc__ = fn.__doc__  # (`textgym plugins NAME` shows it)
        plugin_manager.register_function_plugin(
            "register_responders", name, factory, fn, "@textgym.responder"
        )
        return fn

    return decorator
