"""``megha broker-users``: the federation's vhost, one RabbitMQ user per role and what
each may do there, made with ``rabbitmqctl`` (run where it can reach the node).

    federation file ──broker.gm/lm/reader──▶ add_vhost, add_user / change_password
        (passwords from the password files, on stdin), set_permissions ──▶ RabbitMQ
    broker.queue_signing_key ──missing?──▶ a new random key file (mode 0600)

The permissions (``role_permissions``) are RabbitMQ's three regular expressions per user
on the vhost, matched against exchange and queue names: *configure* to declare or delete
one, *write* to publish to an exchange or bind a queue, *read* to consume a queue or bind
from an exchange. Publishing to a queue by name goes through the default exchange
``amq.default``, so write on it is write on every queue of the vhost: only GMs (who queue
submitted jobs) and LMs (who queue lost and preempted tasks again) have it, and the GMs'
signature check (``services.common.queue_signing``) is what keeps a message that a
holder of it forged from being scheduled. Only GMs may read the user queues.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.common.config import BROKER_ROLES, ConfigError, FederationConfig, read_secret
from services.common.names import (
    BACKLOG_EXCHANGE,
    CANCEL_EXCHANGE,
    EVENT_EXCHANGE,
    HEARTBEAT_EXCHANGE,
)

_CTL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Permissions:
    """RabbitMQ's per-vhost permissions of one user: regular expressions over names."""

    configure: str
    write: str
    read: str


def _any_of(*names: str) -> str:
    # RabbitMQ searches a name for the expression anywhere: anchored, it must be whole.
    return "^(" + "|".join(names) + ")$"


def role_permissions(prefix: str) -> dict[str, Permissions]:
    """What each role may do on the vhost, for a federation with exchange prefix ``prefix``."""
    p = re.escape(prefix)
    heartbeats = f"{p}\\.{re.escape(HEARTBEAT_EXCHANGE)}"
    events = f"{p}\\.{re.escape(EVENT_EXCHANGE)}"
    cancels = f"{p}\\.{re.escape(CANCEL_EXCHANGE)}"
    backlogs = f"{p}\\.{re.escape(BACKLOG_EXCHANGE)}"
    user_queues = f"{p}\\.queue\\.user\\..+"  # names.user_queue
    cancel_queues = f"{p}\\.queue\\.cancels\\..+"  # names.cancel_queue, kept per process
    # A subscriber's exclusive queue: aio-pika's robust channels name it amq_<uuid hex>
    # themselves (to declare it again after a reconnect); the broker's own are amq.gen-*.
    server_named = "amq_[0-9a-f]{32}|amq\\.gen-.*"
    default = "amq\\.default"
    return {
        # Consume and queue jobs; hear heartbeats and events; publish events and cancels;
        # tell and hear the GMs' backlogs.
        "gm": Permissions(
            configure=_any_of(
                heartbeats, events, cancels, backlogs, user_queues, cancel_queues, server_named
            ),
            write=_any_of(default, events, cancels, backlogs, cancel_queues, server_named),
            read=_any_of(
                heartbeats, events, cancels, backlogs, user_queues, cancel_queues, server_named
            ),
        ),
        # Publish heartbeats and events; hear peers' heartbeats and cancels; queue tasks
        # again (declaring the user queue first, so configure on it, but never read it).
        "lm": Permissions(
            configure=_any_of(
                heartbeats, events, cancels, user_queues, cancel_queues, server_named
            ),
            write=_any_of(default, heartbeats, events, cancel_queues, server_named),
            read=_any_of(heartbeats, cancels, cancel_queues, server_named),
        ),
        # Hear events: declare the exchange and an exclusive queue bound to it; nothing else.
        "reader": Permissions(
            configure=_any_of(events, server_named),
            write=_any_of(server_named),
            read=_any_of(events, server_named),
        ),
    }


class BrokerUsersError(RuntimeError):
    """rabbitmqctl is missing or a command of it failed; the message says which and why."""


def _ctl(node: str | None, *args: str, stdin: str | None = None) -> str:
    command = ["rabbitmqctl", *(["-n", node] if node else []), *args]
    try:
        done = subprocess.run(
            command,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=_CTL_TIMEOUT_S,
        )
    except FileNotFoundError:
        raise BrokerUsersError(
            "rabbitmqctl not found: run megha broker-users where RabbitMQ is installed"
        ) from None
    except subprocess.TimeoutExpired:
        raise BrokerUsersError(
            f"rabbitmqctl {args[0]} did not answer in {_CTL_TIMEOUT_S:g} s"
        ) from None
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise BrokerUsersError(
            f"rabbitmqctl {args[0]} failed ({done.returncode}): {' '.join(reason[-3:])}"
        )
    return done.stdout


def _listed(node: str | None, *args: str) -> set[str]:
    """The first column of a rabbitmqctl listing."""
    out = _ctl(node, "-q", "--no-table-headers", *args)
    return {line.split("\t", 1)[0] for line in out.splitlines() if line.strip()}


def _write_new_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text + "\n")


def ensure_secret_files(config: FederationConfig) -> list[str]:
    """Create the password files and the signing key file the config names and that do
    not exist yet, each random and readable by its owner only; returns what it made."""
    made = []
    broker = config.broker
    if broker is None:
        return made
    for role in BROKER_ROLES:
        user = getattr(broker, role)
        if user is not None and not Path(user.password_file).exists():
            _write_new_secret(Path(user.password_file), secrets.token_urlsafe(24))
            made.append(f"password file {user.password_file} ({role})")
    if broker.queue_signing_key and not Path(broker.queue_signing_key).exists():
        _write_new_secret(Path(broker.queue_signing_key), secrets.token_hex(32))
        made.append(f"queue signing key {broker.queue_signing_key}")
    if broker.task_seal_key and not Path(broker.task_seal_key).exists():
        _write_new_secret(Path(broker.task_seal_key), secrets.token_hex(32))
        made.append(f"task seal key {broker.task_seal_key}")
    return made


def broker_users(
    config: FederationConfig, remove_guest: bool = False, node: str | None = None
) -> list[str]:
    """Make the vhost, the role users and their permissions (again, if they exist: their
    passwords and permissions are set to the files' and the role's); returns what it did,
    one line each. ``remove_guest`` deletes RabbitMQ's ``guest`` user."""
    broker = config.broker
    users = {r: getattr(broker, r) for r in BROKER_ROLES} if broker is not None else {}
    users = {role: user for role, user in users.items() if user is not None}
    if not users and not remove_guest:
        raise ConfigError(
            "the federation file names no broker users: add a broker section with gm, lm "
            "and reader (docs/security.md, The broker)"
        )
    done = ensure_secret_files(config)
    done = [f"made {what}" for what in done]
    vhost = config.broker_vhost
    if vhost not in _listed(node, "list_vhosts", "name"):
        _ctl(node, "add_vhost", vhost)
        done.append(f"added vhost {vhost}")
    existing = _listed(node, "list_users")
    permissions = role_permissions(config.exchange_prefix)
    for role, user in users.items():
        password = read_secret(user.password_file)
        # On stdin: an argument would show in the process list.
        if user.name in existing:
            _ctl(node, "change_password", user.name, stdin=password)
            done.append(f"set the password of {role} user {user.name}")
        else:
            _ctl(node, "add_user", user.name, stdin=password)
            done.append(f"added {role} user {user.name}")
        allowed = permissions[role]
        _ctl(
            node,
            "set_permissions",
            "-p",
            vhost,
            user.name,
            allowed.configure,
            allowed.write,
            allowed.read,
        )
        done.append(f"set the permissions of {user.name} on vhost {vhost}")
    if remove_guest:
        if "guest" in existing:
            _ctl(node, "delete_user", "guest")
            done.append("deleted user guest")
        else:
            done.append("user guest was already gone")
    return done
