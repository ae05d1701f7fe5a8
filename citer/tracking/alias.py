"""The registry alias, carried out fail-closed: read it (a dangling or unreadable alias stops the stage), move it only
from the version a sweep compared against, and finish or retire what an interrupted promotion left."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from citer.tracking.store import RegistryError, RouterVersion, _client


class AliasMoved(RegistryError):
    """The alias no longer points at the version the sweep compared against: another writer moved it. ``version``:
    the version registered but not promoted."""

    def __init__(self, message: str, version: str) -> None:
        super().__init__(message)
        self.version = version


# A registered-model tag citer sets beside every alias it moves: an alias that vanished while this tag still names a
# version was deleted outside citer (a dangling alias), which stops every stage instead of reading as "no champion".
ALIAS_TAG = "citer.alias.{alias}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _missing(exc: BaseException) -> bool:
    """MLflow's "no such model" / "no such alias" (anything else: the registry could not be read)."""
    code = str(getattr(exc, "error_code", ""))
    return code == "RESOURCE_DOES_NOT_EXIST" or (
        code == "INVALID_PARAMETER_VALUE" and "not found" in str(exc)
    )


def _recorded_alias(client: Any, model_name: str, alias: str) -> str | None:
    try:
        tags = client.get_registered_model(model_name).tags
    except Exception as exc:
        if _missing(exc):
            return None
        raise RegistryError(
            f"registry: cannot read model '{model_name}' ({_first_line(exc)}); nothing promoted"
        ) from exc
    return tags.get(ALIAS_TAG.format(alias=alias))


def get_alias(model_name: str, alias: str, tracking_uri: str | None = None) -> RouterVersion | None:
    """The version holding ``alias``; None when the model or the alias does not exist and citer never set it.

    Fails closed: an unreadable registry, or an alias citer set whose version is gone (dangling), raises
    :class:`RegistryError` instead of reading as "no champion yet".
    """
    client = _client(tracking_uri)
    try:
        mv = client.get_model_version_by_alias(model_name, alias)
    except Exception as exc:
        if not _missing(exc):
            raise RegistryError(
                f"registry: cannot read alias '{alias}' of '{model_name}' ({_first_line(exc)}); nothing promoted"
            ) from exc
        recorded = _recorded_alias(client, model_name, alias)
        if recorded is not None:
            raise RegistryError(
                f"alias '{alias}' of '{model_name}' held v{recorded} (set by citer) but the registry no longer has "
                f"it: the version or the alias was deleted outside citer. Restore it, or delete the registered model "
                f"tag '{ALIAS_TAG.format(alias=alias)}' to start without a champion; nothing promoted"
            ) from None
        return None
    return RouterVersion(name=model_name, version=str(mv.version), tags=dict(mv.tags), source=mv.source)


def set_alias(model_name: str, alias: str, version: str, tracking_uri: str | None = None) -> None:
    client = _client(tracking_uri)
    client.set_registered_model_alias(model_name, alias, version)
    client.set_registered_model_tag(model_name, ALIAS_TAG.format(alias=alias), str(version))


def move_alias(
    model_name: str, alias: str, version: str, expected: str | None, tracking_uri: str | None = None
) -> None:
    """Move ``alias`` to ``version`` only if it still points at ``expected`` (None: no champion); else
    :class:`AliasMoved`. Call it holding the project lock: the re-read and the move are then one step for citer."""
    current = get_alias(model_name, alias, tracking_uri)
    now = current.version if current else None
    if now != expected:
        was = f"v{expected}" if expected else "no champion"
        raise AliasMoved(
            f"alias '{alias}' moved from {was} to {f'v{now}' if now else 'nothing'} while this sweep ran; "
            f"v{version} is registered but not promoted (rerun the sweep to compare against the new champion)",
            version,
        )
    set_alias(model_name, alias, version, tracking_uri)


def finish_pending(pending: Path, record_path: Path, tracking_uri: str | None = None) -> str | None:
    """Complete or retire what an interrupted sweep left between registering a version, moving the alias and writing
    ``promotion.json`` (``pending`` holds its intent, written before registering). Returns what was done, or None
    when nothing was pending. Call it holding the project lock."""
    from citer.ops.io import read_json, write_json

    if not pending.exists():
        return None
    info = read_json(pending)
    model, alias, expected = info["model"], info["alias"], info["expected"]
    found = _client(tracking_uri).search_model_versions(f"name='{model}' and run_id='{info['run_id']}'")
    if not found:
        pending.unlink()
        return "an interrupted sweep registered no version; its intent was cleared"
    version = str(max(int(mv.version) for mv in found))
    current = get_alias(model, alias, tracking_uri)
    record = dict(info["record"], version=version)
    if info["promote"] and current is not None and current.version == version:
        done = f"v{version} already holds '{alias}'; promotion.json completed"
    elif info["promote"]:
        try:
            move_alias(model, alias, version, expected, tracking_uri)
            done = f"v{version} moved to '{alias}' as the interrupted sweep decided"
        except AliasMoved as exc:
            _client(tracking_uri).set_model_version_tag(model, version, "citer.retired", str(exc))
            record.update(promoted=0, reason=f"{record['reason']}; retired after an interruption: {exc}")
            done = f"v{version} retired (tag citer.retired): {exc}"
    else:
        done = f"v{version} was registered without promotion; promotion.json completed"
    record["recovered"] = done
    write_json(record_path, record)
    pending.unlink()
    return done
