#!/usr/bin/env bash
# Makes deploy/certs/, the test certificates docker-compose.yml mounts, with
# Debian's openssl (EC P-256). Git-ignored: every machine makes its own, and
# no key is ever committed. Production certificates come from your own CA.
#
#   ca/cluster-ca.{pem,key}    the cluster CA: signs the components' certificates
#   cluster-ca.pem             its certificate, mounted in every Spillway container
#   storage, engine, gateway, management .{pem,key}
#                              one certificate per component for the internal
#                              gRPC's mutual TLS (cluster.tls.*): serverAuth and
#                              clientAuth, SANs = the compose service name(s)
#                              and the role (URI spillway://role/<role>)
#   ca/client-ca.{pem,key}     the client-facing CA: signs the server certificate
#   client-ca.pem              its certificate: what AMQPS clients, spillctl and
#                              the loadgens trust
#   server.{pem,key}           the gateways' AMQPS and management's TLS
#                              certificate: SANs gateway, gateway2, management,
#                              localhost, 127.0.0.1 (the published ports)
#
#   deploy/make-certs.sh            make what is missing, and re-issue any leaf
#                                   certificate that expires within 30 days
#                                   (make images, the compose scripts)
#   deploy/make-certs.sh --renew    re-issue every leaf certificate (new keys)
#                                   with the same CAs
#   deploy/make-certs.sh --new-ca   new CAs and everything they sign
# Then recreate the containers: docker-compose up -d --force-recreate.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)/certs"
mode=missing
case "${1:-}" in
    "") ;;
    --renew) mode=renew ;;
    --new-ca) mode=new-ca ;;
    *) echo "usage: $0 [--renew | --new-ca]" >&2; exit 2 ;;
esac
command -v openssl >/dev/null 2>&1 || { echo "make-certs: openssl is needed (apt-get install openssl)" >&2; exit 1; }
umask 077
mkdir -p "$dir/ca"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
made=()

# ca NAME CN: a self-signed CA (critical basicConstraints and keyUsage, a
# subject key identifier), 10 years.
ca() {
    local name="$1" cn="$2"
    if [[ "$mode" != new-ca && -s "$dir/ca/$name.pem" && -s "$dir/ca/$name.key" ]]; then
        return 0
    fi
    openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
        -keyout "$tmp/$name.key" -out "$tmp/$name.pem" -subj "/CN=$cn" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
        -addext "subjectKeyIdentifier=hash" 2>/dev/null
    mv "$tmp/$name.key" "$dir/ca/$name.key"
    mv "$tmp/$name.pem" "$dir/ca/$name.pem"
    made+=("ca/$name")
    # A new CA: everything it signed must be issued again.
    mode=renew-all-of-$name
}

# The SANs of a certificate as `leaf` takes them: "DNS:a,DNS:b,IP:1.2.3.4".
sans_of() {
    openssl x509 -in "$1" -noout -ext subjectAltName 2>/dev/null | tail -n +2 \
        | tr -d ' ' | sed 's/IPAddress:/IP:/g'
}

# leaf NAME CA EKU SANS: a certificate signed by CA, 1 year.
leaf() {
    local name="$1" ca="$2" eku="$3" sans="$4"
    local issue=no
    if [[ "$mode" == renew || "$mode" == new-ca || "$mode" == "renew-all-of-$ca" ]]; then
        issue=yes
    elif [[ ! -s "$dir/$name.pem" || ! -s "$dir/$name.key" ]]; then
        issue=yes
    elif ! openssl x509 -in "$dir/$name.pem" -noout -checkend $((30 * 86400)) >/dev/null 2>&1; then
        issue=yes
    elif ! openssl verify -CAfile "$dir/ca/$ca.pem" "$dir/$name.pem" >/dev/null 2>&1; then
        issue=yes
    elif [[ "$(sans_of "$dir/$name.pem")" != "$sans" ]]; then
        issue=yes   # the names changed (a service was added or renamed)
    fi
    [[ "$issue" == yes ]] || return 0
    printf '%s\n' "subjectAltName=$sans" "basicConstraints=critical,CA:FALSE" \
        "keyUsage=critical,digitalSignature" "extendedKeyUsage=$eku" \
        "authorityKeyIdentifier=keyid" "subjectKeyIdentifier=hash" >"$tmp/$name.ext"
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
        -keyout "$tmp/$name.key" -out "$tmp/$name.csr" -subj "/CN=$name" 2>/dev/null
    openssl x509 -req -in "$tmp/$name.csr" -CA "$dir/ca/$ca.pem" -CAkey "$dir/ca/$ca.key" \
        -CAcreateserial -CAserial "$dir/ca/$ca.srl" -days 365 \
        -out "$tmp/$name.pem" -extfile "$tmp/$name.ext" 2>/dev/null
    mv "$tmp/$name.key" "$dir/$name.key"
    mv "$tmp/$name.pem" "$dir/$name.pem"
    made+=("$name")
}

start_mode="$mode"
ca cluster-ca "Spillway cluster CA (compose test)"
# The storage nodes share one certificate, and so do the engines: each is
# dialled by its own service name.
# Each names its role (URI spillway://role/<role>): the servers let a
# certificate make only that role's calls (docs/security.md).
leaf storage cluster-ca "serverAuth,clientAuth" \
    "DNS:storage-1,DNS:storage-2,DNS:storage-3,URI:spillway://role/storage"
leaf engine cluster-ca "serverAuth,clientAuth" "DNS:engine-1,DNS:engine-2,URI:spillway://role/engine"
leaf management cluster-ca "serverAuth,clientAuth" "DNS:management,URI:spillway://role/management"
# Both gateways present one certificate: they are clients of the engine only.
leaf gateway cluster-ca "serverAuth,clientAuth" "DNS:gateway,DNS:gateway2,URI:spillway://role/gateway"
mode="$start_mode"
ca client-ca "Spillway client CA (compose test)"
leaf server client-ca "serverAuth" \
    "DNS:gateway,DNS:gateway2,DNS:management,DNS:localhost,IP:127.0.0.1"
mode="$start_mode"

# What the containers and clients read: the CAs' certificates, never their keys.
cp "$dir/ca/cluster-ca.pem" "$dir/cluster-ca.pem"
cp "$dir/ca/client-ca.pem" "$dir/client-ca.pem"
# Certificates are public; keys stay the owner's (the containers run as root).
chmod 644 "$dir"/*.pem
chmod 600 "$dir"/*.key "$dir"/ca/*.key
if [[ ${#made[@]} -gt 0 ]]; then
    echo "make-certs: made ${made[*]} in $dir"
fi
