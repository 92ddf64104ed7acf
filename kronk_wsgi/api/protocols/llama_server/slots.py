"""llama-server's slot actions: a slot's state saved to a file, restored from one, or erased (admin keys only).

Files live in the ``slot_save_path`` setting's folder (0700), named by the client with a plain file name (no path
leaves the folder), each readable by this user alone (0600) and never read or written through a link. A file holds
the engine's state and the tokens it holds, with what the state depends on (the model file, the engine, the
context): it is restored only into the same. Only engines with a state API (llama.cpp) save and restore; erasing
works on any.
"""

import errno
import json
import os
import re
import time
from pathlib import Path
from typing import Optional

from flask import jsonify, request

from ....engine.base import EngineError, Slot
from ....private_files import open_private, private_folder, write_private
from ....serving import offload
from ....serving.pool import LoadedModel
from ...body import parse_body
from ...errors import ApiError, invalid
from ...schemas import Strict
from ...sessions import cache_scope, use_model
from ...state import state
from .protocol import bp

FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
MAGIC = b"kronk_wsgi slot state\n"


class SlotFile(Strict):
    filename: Optional[str] = None


def _folder() -> Path:
    folder = state().settings.slot_save_path
    if folder is None:
        raise ApiError(501, "slots are saved and restored only with the slot_save_path setting", code="not_supported")
    return Path(folder).expanduser()


def _file(body: SlotFile) -> Path:
    name = body.filename or ""
    if not FILE_NAME.fullmatch(name) or ".." in name:
        raise invalid("filename must be a plain file name (letters, digits, '.', '_', '-'), no path", param="filename")
    return _folder() / name


def _save(slot: Slot, identity: str, path: Path) -> tuple[int, int]:
    tokens = list(slot.cached)
    data = slot.save_state()
    header = json.dumps({"identity": identity, "tokens": tokens}).encode()
    private_folder(path.parent)
    write_private(path, [MAGIC, len(header).to_bytes(8, "little"), header, data])
    return len(tokens), len(MAGIC) + 8 + len(header) + len(data)


def _read(path: Path) -> bytes:
    """A slot file's bytes; 404 if there is none, 400 if it is no regular file (a link is never followed)."""
    try:
        fd, size = open_private(path)
    except FileNotFoundError:
        raise ApiError(404, f"no saved slot file {path.name!r}", code="not_found") from None
    except ValueError:
        raise invalid(f"{path.name!r} is not a slot file of this server", param="filename") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise invalid(f"{path.name!r} is a link: slot files are read from the folder itself", param="filename") \
            from None
    with os.fdopen(fd, "rb") as file:
        return file.read(size)


def _restore(slot: Slot, identity: str, path: Path, scope: str) -> tuple[int, int]:
    data = _read(path)
    if not data.startswith(MAGIC):
        raise invalid(f"{path.name!r} is not a slot file of this server", param="filename")
    size = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8 + size
    try:
        header = json.loads(data[len(MAGIC) + 8:start])
        tokens = [int(token) for token in header["tokens"]]
    except (ValueError, KeyError, TypeError):
        raise invalid(f"{path.name!r} is damaged", param="filename") from None
    if header.get("identity") != identity:
        raise invalid(f"{path.name!r} was saved from another model, engine or context size", param="filename")
    slot.enter(scope)
    slot.load_state(memoryview(data)[start:], tokens)
    return len(tokens), len(data)


def _erase(slot: Slot) -> int:
    erased = len(slot.cached)
    slot.cached.clear()
    return erased


def _holding(model: LoadedModel, number: int, action) -> object:
    """``action(slot)`` on the slot numbered ``number``, in a slot thread, once that slot is free (waiting up to the
    admission timeout)."""
    scheduler = model.scheduler
    if not 0 <= number < len(scheduler.slots):
        raise invalid(f"slot {number} does not exist (this model has {len(scheduler.slots)})", param="id_slot")
    ticket = scheduler.wait_for_slot((), cache_scope(), number)
    if not ticket.granted.wait(state().settings.admission_timeout):
        scheduler.leave(ticket)
        raise ApiError(503, f"slot {number} stayed busy", code="slot_busy", headers={"Retry-After": "5"})
    try:
        return offload.call(model.slot_threads, action, ticket.slot)
    finally:
        model.give_back(ticket.slot)


@bp.post("/slots/<int:number>")
def slot_action(number: int):
    """?action=save, restore or erase the slot's state (for the default model, or ``?model=``)."""
    action = request.args.get("action")
    if action not in ("save", "restore", "erase"):
        raise invalid("action must be save, restore or erase", param="action")
    body = parse_body(SlotFile, json_type=False) if action != "erase" else None
    model_id = request.args.get("model") or state().settings.default_model
    with use_model(model_id) as model:
        if action == "erase":
            return jsonify({"id_slot": number, "n_erased": _holding(model, number, _erase)})
        path = _file(body)
        identity = model.engine.state_identity()
        if identity is None:
            raise ApiError(501, f"the {model.engine.kind.name} engine cannot save or restore a slot's state",
                           code="not_supported")
        started = time.monotonic()
        scope = cache_scope()
        try:
            if action == "save":
                tokens, size = _holding(model, number, lambda slot: _save(slot, identity, path))
            else:
                tokens, size = _holding(model, number, lambda slot: _restore(slot, identity, path, scope))
        except EngineError as exc:
            raise ApiError(500, f"the slot's state could not be {action}d: {exc}", code="engine_error") from None
        except OSError as exc:
            raise ApiError(500, f"the slot file could not be {'written' if action == 'save' else 'read'}: "
                           f"{exc.strerror}", code="slot_file_error") from None
        ms = (time.monotonic() - started) * 1000
        if action == "save":
            return jsonify({"id_slot": number, "filename": path.name, "n_saved": tokens, "n_written": size,
                            "timings": {"save_ms": ms}})
        return jsonify({"id_slot": number, "filename": path.name, "n_restored": tokens, "n_read": size,
                        "timings": {"restore_ms": ms}})

