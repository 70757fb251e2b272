"""A real Mosquitto broker for tests: a temp config, a free loopback port, started and stopped
(and restarted on the same port) by the test, plus the certificates for a TLS listener made
with openssl, and `mosquitto_sub` as the independent client. Nothing here touches the
machine's own mosquitto service or /etc/mosquitto.

Persistence is off unless asked for: a restart then loses every session and retained
message, which is the harshest outage a device can see.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
MOSQUITTO_SUB = shutil.which("mosquitto_sub") or "mosquitto_sub"
MOSQUITTO_PUB = shutil.which("mosquitto_pub") or "mosquitto_pub"
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd") or "mosquitto_passwd"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range.

    Not port 0's choice: that comes from the ephemeral range, where a client retrying a
    stopped broker on the same port can be given that port as its own source port and
    connect to itself (TCP simultaneous open). The orphaned self-connection then holds the
    port and the restarted broker fails with "Address already in use" (seen once in CI).
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()  # independent per xdist worker
    for _ in range(200):
        port = rng.randrange(max(1024, low - 20000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low}")


def wait_port(port: int, timeout: float = 10.0, *, open_: bool = True) -> None:
    """Until 127.0.0.1:port accepts (open_) or refuses (not open_) a TCP connection."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                accepting = True
        except OSError:
            accepting = False
        if accepting == open_:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"127.0.0.1:{port} still {'closed' if open_ else 'open'}")
        time.sleep(0.02)


@dataclass(frozen=True)
class Certs:
    """PEM files made by openssl: a CA, a server certificate for 127.0.0.1/localhost, a client
    certificate, and a second CA that signed nothing of ours (the "wrong CA")."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def make_certs(folder: Path) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    def ca(name: str) -> None:
        run(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-sha256",
            "-subj",
            f"/CN=edged test {name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.pem",
        )

    def signed(name: str, subject: str, ext: str) -> None:
        (folder / f"{name}.ext").write_text(ext)
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            subject,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-sha256",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.pem",
        )

    ca("ca")
    ca("other-ca")
    signed(
        "server",
        "/CN=localhost",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    signed("client", "/CN=edged-test-device", "extendedKeyUsage=clientAuth\n")
    return Certs(
        ca=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
        other_ca=folder / "other-ca.pem",
    )


class Broker:
    """One mosquitto process on 127.0.0.1:port (and tls_port when certs are given).

    `users` ({name: password}) turns anonymous access off and writes a password_file with
    `mosquitto_passwd -b`. `stop()` then `start()` brings it back on the same ports.
    """

    def __init__(
        self,
        folder: Path,
        *,
        certs: Certs | None = None,
        users: dict[str, str] | None = None,
        require_client_cert: bool = False,
        persistence: bool = False,
    ):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.tls_port = free_port() if certs else None
        self.certs = certs
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = folder / "mosquitto.log"
        self.config = folder / "mosquitto.conf"
        lines = [
            # persistence: sessions of persistent subscribers (and their queued QoS 1
            # messages) survive a restart, as on a production broker; saved at SIGTERM.
            *(
                ["persistence true", f"persistence_location {folder}/"]
                if persistence
                else ["persistence false"]
            ),
            f"log_dest file {self.log}",
            "log_type all",
            # Root would otherwise drop to the "mosquitto" user, who cannot read our temp files.
            *(["user root"] if os.geteuid() == 0 else []),
            # The replay tests queue hundreds of QoS 1 messages for one subscriber; the
            # default of 1000 queued per client must not be what they measure.
            "max_queued_messages 0",
            f"listener {self.port} 127.0.0.1",
        ]
        auth = ["allow_anonymous true"]
        if users:
            pwfile = folder / "passwd"
            pwfile.touch(mode=0o600)
            for name, password in users.items():
                subprocess.run(
                    [MOSQUITTO_PASSWD, "-b", str(pwfile), name, password],
                    check=True,
                    capture_output=True,
                )
            auth = ["allow_anonymous false", f"password_file {pwfile}"]
        lines += auth
        if certs:
            lines += [
                f"listener {self.tls_port} 127.0.0.1",
                f"cafile {certs.ca}",
                f"certfile {certs.server_cert}",
                f"keyfile {certs.server_key}",
                f"require_certificate {'true' if require_client_cert else 'false'}",
                *auth,
            ]
        # per_listener_settings lets each listener carry its own auth lines.
        self.config.write_text("per_listener_settings true\n" + "\n".join(lines) + "\n")

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def tls_url(self) -> str:
        return f"mqtts://127.0.0.1:{self.tls_port}"

    def start(self) -> Broker:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            for port in (self.port, self.tls_port):
                if port is not None:
                    wait_port(port)
        except TimeoutError:
            self.proc.kill()
            _, err = self.proc.communicate()
            self.proc = None
            raise RuntimeError(
                f"mosquitto did not start: {err.decode(errors='replace')}; "
                f"log: {self.log_text()[-2000:]}"
            ) from None
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        wait_port(self.port, open_=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sub_once(
    port: int, topic: str, *, count: int = 1, wait_s: float = 10.0, extra: tuple[str, ...] = ()
) -> list[dict]:
    """`mosquitto_sub -C count -W wait_s`: the independent client's view (retained messages
    included), each payload parsed as JSON."""
    out = subprocess.run(
        [
            MOSQUITTO_SUB,
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-t",
            topic,
            "-C",
            str(count),
            "-W",
            str(int(wait_s)),
            "-q",
            "1",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=wait_s + 5,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def pub(port: int, topic: str, payload: str, *extra: str) -> None:
    subprocess.run(
        [
            MOSQUITTO_PUB,
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-t",
            topic,
            "-m",
            payload,
            "-q",
            "1",
            *extra,
        ],
        check=True,
        capture_output=True,
        timeout=10,
    )


def first_seen(seqs: list[int]) -> list[int]:
    """The seqs in arrival order with QoS 1 duplicates (a re-send of a message whose PUBACK
    was lost with the connection) left out."""
    seen: set[int] = set()
    return [s for s in seqs if not (s in seen or seen.add(s))]


class SubProcess:
    """A `mosquitto_sub` left running, read after the fact. `-F` prints the MQTT 5 message
    expiry, the retain flag, the topic and the payload of each message on one line."""

    def __init__(
        self, port: int, topics: str | list[str], out: Path, *extra: str, auth: tuple[str, ...] = ()
    ):
        self.port = port
        self.out = out
        self.auth = auth
        self.probe_topic = f"edged-test/probe/{uuid.uuid4().hex}"
        self._file = out.open("wb")
        topics = [topics] if isinstance(topics, str) else topics
        args = [a for t in [*topics, self.probe_topic] for a in ("-t", t)]
        self.proc = subprocess.Popen(
            [
                MOSQUITTO_SUB,
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                *args,
                "-q",
                "1",
                "-V",
                "mqttv5",
                "-F",
                "%E|%r|%t|%p",
                *auth,
                *extra,
            ],
            stdout=self._file,
            stderr=subprocess.STDOUT,
        )

    def ready(self, timeout: float = 10.0) -> SubProcess:
        """Until the subscription is in place: probe messages until one comes back."""
        deadline = time.monotonic() + timeout
        while True:
            pub(self.port, self.probe_topic, "{}", *self.auth)
            try:
                self.wait_for(lambda _: self.probed(), timeout=0.3)
                return self
            except TimeoutError:
                if time.monotonic() > deadline:
                    self.close()
                    raise
            except subprocess.CalledProcessError:
                self.close()
                raise

    def probed(self) -> bool:
        return f"|{self.probe_topic}|" in self.out.read_text()

    def messages(self) -> list[Message]:
        result = []
        for line in self.out.read_text().splitlines():
            expiry, retain, topic, payload = [*line.split("|", 3), "", "", ""][:4]
            if topic == self.probe_topic:
                continue
            try:
                data = json.loads(payload)
            except ValueError:
                continue
            result.append(
                Message(topic, data, retain == "1", int(expiry) if expiry.isdigit() else None)
            )
        return result

    def wait_for(self, predicate, timeout: float = 10.0) -> list[Message]:
        deadline = time.monotonic() + timeout
        while True:
            messages = self.messages()
            if predicate(messages):
                return messages
            if time.monotonic() > deadline:
                raise TimeoutError(f"mosquitto_sub saw: {messages[-10:]}")
            time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._file.close()


@dataclass(frozen=True)
class Message:
    topic: str
    payload: dict
    retained: bool
    expiry: int | None  # MQTT 5 message expiry interval left, when the message had one


def wait(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Until predicate() holds, polling; TimeoutError(what) after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)
