"""AMQPS (TLS) with pika and, over AMQP 1.0 on the same port, with Qpid Proton: a
round trip over TLS with PLAIN, and SASL EXTERNAL with a client certificate whose CN
is a configured user.

The certificates are made here with ``cryptography`` (never committed keys): a CA whose
basicConstraints and keyUsage are critical and which has a subject key identifier, and
server and client certificates with authority key identifiers, so that the strict X.509
checks of Python 3.13+ (``VERIFY_X509_STRICT`` in ``ssl.create_default_context``) pass
as well as 3.11's.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from pathlib import Path

import pika
import pika.credentials
import pika.exceptions
import pytest
from cryptography import x509
from proton import ConnectionException, Message, SSLDomain
from proton.utils import BlockingConnection
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from spillway_testlib import SpillwayBroker, uniq

CERT_USER = "app"

if os.environ.get("SPILLWAY_TEST_AMQP_URL"):
    pytest.skip("starts its own TLS-configured broker", allow_module_level=True)

WIRINGS = [w.strip() for w in
           os.environ.get("SPILLWAY_TEST_WIRINGS", "all-in-one,separate").split(",")
           if w.strip()]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def make_pki(dir: Path) -> dict[str, Path]:
    """ca.pem; server.pem/.key (localhost, 127.0.0.1); client.pem/.key (CN app)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=30)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder()
          .subject_name(_name("Spillway pytest CA")).issuer_name(_name("Spillway pytest CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))
    aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    paths = {"ca": dir / "ca.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(name: str, cn: str, usage, sans=None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(_name(cn)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False,
                                                key_agreement=False, key_cert_sign=False,
                                                crl_sign=False, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                                  critical=False)
                   .add_extension(aki, critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        paths[name] = dir / f"{name}.pem"
        paths[name + "_key"] = dir / f"{name}.key"
        paths[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(paths[name + "_key"], key)

    issue("server", "localhost", ExtendedKeyUsageOID.SERVER_AUTH,
          [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    issue("client", CERT_USER, ExtendedKeyUsageOID.CLIENT_AUTH)
    return paths


@pytest.fixture(scope="module", params=WIRINGS)
def tls_broker(request, tmp_path_factory):
    dir = tmp_path_factory.mktemp(f"tls-{request.param}")
    pki = make_pki(dir)
    # Client certificates optional (ca_file without verify_peer): PLAIN without one,
    # EXTERNAL with one.
    config = f"""
[gateway]
amqps_listen = "127.0.0.1:0"

[gateway.tls]
cert_file = "{pki['server']}"
key_file = "{pki['server_key']}"
ca_file = "{pki['ca']}"

[[engine.users]]
name = "guest"
password = "guest"
loopback_only = true

[[engine.users]]
name = "{CERT_USER}"
password = "not-used-with-a-certificate"
"""
    broker = SpillwayBroker(request.param, dir / "broker", config=config)
    try:
        broker.start()
        assert broker.amqps_port, "the ready file has no amqps address"
        yield broker, pki
    finally:
        try:
            broker.stop()
        finally:
            broker.kill()


def _context(pki, client: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if client:
        context.load_cert_chain(str(pki["client"]), str(pki["client_key"]))
    return context


def _params(broker, pki, client: bool, credentials) -> pika.ConnectionParameters:
    return pika.ConnectionParameters(
        host="127.0.0.1", port=broker.amqps_port, virtual_host="/",
        credentials=credentials, connection_attempts=1,
        ssl_options=pika.SSLOptions(_context(pki, client), server_hostname="localhost"))


def _round_trip(conn, user_id: str) -> None:
    ch = conn.channel()
    queue = uniq("tls")
    ch.queue_declare(queue, auto_delete=True)
    ch.confirm_delivery()
    body = os.urandom(200_000)
    ch.basic_publish("", queue, body, pika.BasicProperties(user_id=user_id))
    method, props, got = ch.basic_get(queue, auto_ack=True)
    assert method is not None, "nothing came back over TLS"
    assert got == body and props.user_id == user_id
    ch.close()


def test_round_trip_over_amqps(tls_broker):
    broker, pki = tls_broker
    conn = pika.BlockingConnection(
        _params(broker, pki, False, pika.PlainCredentials("guest", "guest")))
    try:
        _round_trip(conn, "guest")
    finally:
        conn.close()


def test_external_with_a_client_certificate(tls_broker):
    broker, pki = tls_broker
    conn = pika.BlockingConnection(
        _params(broker, pki, True, pika.credentials.ExternalCredentials()))
    try:
        # Logged in as the certificate's CN: a user_id of app is accepted.
        _round_trip(conn, CERT_USER)
    finally:
        conn.close()


def test_external_is_not_offered_without_a_certificate(tls_broker):
    broker, pki = tls_broker
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(
            _params(broker, pki, False, pika.credentials.ExternalCredentials()))


# ------------------------------------------------------------------ AMQP 1.0

def _amqp1(broker, pki, client: bool, mechs: str, user=None, password=None):
    """A Proton connection to the AMQPS port, checking the server's certificate
    for localhost; with the client certificate when `client`."""
    domain = SSLDomain(SSLDomain.MODE_CLIENT)
    domain.set_trusted_ca_db(str(pki["ca"]))
    domain.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)
    if client:
        domain.set_credentials(str(pki["client"]), str(pki["client_key"]), None)
    return BlockingConnection(f"amqps://127.0.0.1:{broker.amqps_port}", ssl_domain=domain,
                              sni="localhost", allowed_mechs=mechs, user=user,
                              password=password, virtual_host="vhost:/", timeout=10)


def _amqp1_round_trip(broker, pki, conn, user_id: str) -> None:
    """Declares a queue over 0-9-1 on the same TLS port, then sends a message
    with `user_id` over 1.0 and receives it back."""
    declaring = pika.BlockingConnection(
        _params(broker, pki, False, pika.PlainCredentials("guest", "guest")))
    try:
        queue = uniq("tls1")
        declaring.channel().queue_declare(queue, auto_delete=False)
        body = os.urandom(100_000)
        conn.create_sender(f"/queues/{queue}").send(Message(body=body, user_id=user_id.encode()))
        receiver = conn.create_receiver(f"/queues/{queue}")
        got = receiver.receive(timeout=10)
        receiver.accept()
        assert bytes(got.body) == body and got.user_id == user_id.encode()
        declaring.channel().queue_delete(queue)
    finally:
        declaring.close()


def test_amqp1_round_trip_over_amqps_with_plain(tls_broker):
    broker, pki = tls_broker
    conn = _amqp1(broker, pki, False, "PLAIN", user="guest", password="guest")
    try:
        _amqp1_round_trip(broker, pki, conn, "guest")
    finally:
        conn.close()


def test_amqp1_external_with_a_client_certificate(tls_broker):
    broker, pki = tls_broker
    conn = _amqp1(broker, pki, True, "EXTERNAL")
    try:
        # Logged in as the certificate's CN: a user-id of app is accepted.
        _amqp1_round_trip(broker, pki, conn, CERT_USER)
    finally:
        conn.close()


def test_amqp1_external_is_not_offered_without_a_certificate(tls_broker):
    broker, pki = tls_broker
    with pytest.raises(ConnectionException):
        _amqp1(broker, pki, False, "EXTERNAL")
