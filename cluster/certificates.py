"""A cluster's own certificate authority for mutual TLS (``pdserve serve --cluster-tls
auto``; docs/architecture.md, Lifecycle and failure).

``ClusterCA.generate()`` makes a new CA (an EC P-256 key and a self-signed certificate)
in memory; ``issue(name, hosts)`` gives one member (the router, each worker) a key and a
certificate of its own, signed by the CA, naming the addresses it advertises as DNS or IP
subject alternative names. The CA's private key is never written anywhere and cannot be
pickled: it stays in the process that issues (Ray passes each worker actor only its own
``ClusterTLS``, which holds the CA's certificate, not its key).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable

from pdserve.cluster.auth import ClusterTLS

CA_VALIDITY_DAYS = 365
MEMBER_VALIDITY_DAYS = 365
CLOCK_SLACK = datetime.timedelta(hours=1)  # not-before this far back, for skewed clocks


def subject_alternative_names(hosts: Iterable[str]) -> list:
    """``hosts`` as x509 general names: an IP address as ``IPAddress``, anything else as
    ``DNSName``.

    Raises:
        ValueError: an empty host.
    """
    from cryptography import x509

    names = []
    for host in dict.fromkeys(hosts):
        if not host:
            raise ValueError("a certificate's host must not be empty")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


class ClusterCA:
    """One cluster's certificate authority, in memory.

    Raises ``TypeError`` when pickled: its key never leaves this process.
    """

    def __init__(self, key, certificate) -> None:
        self._key = key
        self.certificate = certificate

    @classmethod
    def generate(cls, name: str = "pdserve cluster CA") -> ClusterCA:
        """A new CA named ``name``, valid for ``CA_VALIDITY_DAYS`` days."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        certificate = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SLACK)
            .not_valid_after(now + datetime.timedelta(days=CA_VALIDITY_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
        return cls(key, certificate)

    def __reduce__(self):
        raise TypeError("a ClusterCA's private key never leaves the process that issues; "
                        "pass members the ClusterTLS that issue() returns")

    @property
    def certificate_pem(self) -> bytes:
        """The CA's certificate (PEM): what every member verifies the others against."""
        from cryptography.hazmat.primitives import serialization

        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, hosts: Iterable[str]) -> ClusterTLS:
        """A new key and certificate for the member ``name`` (its common name), with every
        address in ``hosts`` (those it advertises; at least one) as a subject alternative
        name, usable as a TLS server and client; valid ``MEMBER_VALIDITY_DAYS`` days.

        Raises:
            ValueError: no host, or an empty one.
        """
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        names = subject_alternative_names(hosts)
        if not names:
            raise ValueError(f"the certificate of {name!r} needs at least one host")
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SLACK)
            .not_valid_after(now + datetime.timedelta(days=MEMBER_VALIDITY_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256()))
        return ClusterTLS(
            certificate.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
            self.certificate_pem)
