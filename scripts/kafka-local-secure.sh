# shellcheck shell=bash
# Sourced by scripts/kafka-local for `start --secure [--mtls]`: a throw-away CA, the broker's and
# every role's certificate (openssl), one SCRAM-SHA-512 user per gpupipe role plus admin, and the
# server.properties lines for a SASL_SSL listener and an mTLS listener behind the StandardAuthorizer
# with allow.everyone.if.no.acl.found=false.
#
# No password is ever on a command line: the broker talks to itself (inter-broker, controller) with
# its certificate over mTLS, and the SCRAM users are created after start through the mTLS listener
# with the admin certificate, by a Python snippet that reads the password files itself.
#
# Layout under $STATE/secure (kept across restarts; `--fresh` makes new ones):
#   ca.pem                      the CA clients must trust (ssl.ca.location)
#   broker.pem                  broker key + certificate (CN=broker, SAN 127.0.0.1/localhost)
#   clients/<role>.properties   gpupipe --kafka-config-file for SASL_SSL (password by file)
#   clients/<role>-mtls.properties  the same role over mTLS (certificate, no password; with --mtls)
#   credentials/<role>.password the role's SCRAM password (mode 0600)
#   certs/<role>.pem, <role>.key    the role's client certificate (CN=<role>) for mTLS
#
# Principals: User:<role> on both listeners (SCRAM user name, or the certificate's CN through
# ssl.principal.mapping.rules). User:admin and User:broker (the broker itself, inter-broker and on
# the controller listener) are super users; everybody else needs ACLs (`gpupipe acls --apply`).
# The mTLS listener (KAFKA_MTLS_PORT, default port+2) is always there, the broker uses it; --mtls
# writes client configs for it and lists it.

SECURE_ROLES=(producer metrics chargeback alerts recommend report lake tail admin)

secure_dir() { echo "$STATE/secure"; }

_hexpw() { od -An -tx1 -N16 /dev/urandom | tr -d ' \n'; }

_sign() {  # name cn [san]
  local d=$1 name=$2 cn=$3 san=${4:-}
  openssl req -new -newkey rsa:2048 -nodes -keyout "$d/$name.key" -subj "/CN=$cn" \
    -out "$d/$name.csr" 2>/dev/null || die "openssl: cannot create key for $cn"
  local ext=$d/$name.ext
  printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' >"$ext"
  [[ -n $san ]] && printf 'subjectAltName=%s\n' "$san" >>"$ext"
  openssl x509 -req -in "$d/$name.csr" -CA "$SEC/ca.pem" -CAkey "$SEC/ca.key" -CAcreateserial \
    -days 30 -sha256 -extfile "$ext" -out "$d/$name.pem" 2>/dev/null || die "openssl: cannot sign certificate for $cn"
  rm -f "$d/$name.csr" "$ext"
}

# Create CA, certificates and passwords unless they exist.
secure_material() {
  SEC=$(secure_dir)
  [[ -f $SEC/.complete ]] && return 0
  command -v openssl >/dev/null 2>&1 || die "openssl not found (needed for --secure)"
  log "generating a throw-away CA, certificates and SCRAM credentials in $SEC"
  rm -rf "$SEC"
  mkdir -p "$SEC/clients" "$SEC/credentials" "$SEC/certs"
  chmod 700 "$SEC" "$SEC/credentials" "$SEC/certs"
  openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$SEC/ca.key" -out "$SEC/ca.pem" -days 30 -sha256 \
    -subj "/CN=gpupipe-local-ca/O=gpupipe-local" 2>/dev/null || die "openssl: cannot create the CA"
  _sign "$SEC" broker-cert broker "IP:127.0.0.1,DNS:localhost"
  # Kafka's PEM keystore: the private key (PKCS#8) followed by the certificate chain.
  cat "$SEC/broker-cert.key" "$SEC/broker-cert.pem" "$SEC/ca.pem" >"$SEC/broker.pem"
  rm -f "$SEC/broker-cert.key" "$SEC/broker-cert.pem"
  chmod 600 "$SEC/broker.pem"
  local role
  for role in "${SECURE_ROLES[@]}"; do
    _hexpw >"$SEC/credentials/$role.password"
    chmod 600 "$SEC/credentials/$role.password"
    _sign "$SEC/certs" "$role" "$role"
    chmod 600 "$SEC/certs/$role.key"
  done
  touch "$SEC/.complete"
}

# Client configs need the port, so they are rewritten on every start.
secure_client_configs() {
  local port=$1 mport=$2 mtls=$3 role
  for role in "${SECURE_ROLES[@]}"; do
    cat >"$SEC/clients/$role.properties" <<EOF
# gpupipe --kafka-config-file for role $role (written by scripts/kafka-local start --secure)
bootstrap.servers=$HOST:$port
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.username=$role
sasl.password.file=$SEC/credentials/$role.password
ssl.ca.location=$SEC/ca.pem
EOF
    if (( mtls )); then
      cat >"$SEC/clients/$role-mtls.properties" <<EOF
# gpupipe --kafka-config-file for role $role over mTLS (principal User:$role from the certificate CN)
bootstrap.servers=$HOST:$mport
security.protocol=SSL
ssl.ca.location=$SEC/ca.pem
ssl.certificate.location=$SEC/certs/$role.pem
ssl.key.location=$SEC/certs/$role.key
EOF
    else
      rm -f "$SEC/clients/$role-mtls.properties"
    fi
  done
}

# server.properties lines replacing the PLAINTEXT listener block.
secure_server_config() {
  local port=$1 cport=$2 mport=$3
  local listeners="SASL_SSL://$HOST:$port,CONTROLLER://$HOST:$cport,MTLS://$HOST:$mport"
  cat <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=$HOST:$cport
listeners=$listeners
advertised.listeners=$listeners
inter.broker.listener.name=MTLS
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:SSL,SASL_SSL:SASL_SSL,MTLS:SSL

# --secure: TLS everywhere; SCRAM-SHA-512 on SASL_SSL; certificates on CONTROLLER and MTLS (the
# broker itself, admin, --mtls clients); principal = SCRAM user or certificate CN; deny unless an
# ACL allows. No password in this file.
ssl.keystore.type=PEM
ssl.keystore.location=$SEC/broker.pem
ssl.truststore.type=PEM
ssl.truststore.location=$SEC/ca.pem
ssl.endpoint.identification.algorithm=https
listener.name.controller.ssl.client.auth=required
listener.name.mtls.ssl.client.auth=required
ssl.principal.mapping.rules=RULE:^CN=([^,]+)\$/\$1/,DEFAULT
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:broker
EOF
}

# Readiness-probe settings (env KAFKA_LOCAL_PROBE_CONF, newline-separated key=value): the admin
# certificate on the mTLS listener, which works before any SCRAM user exists.
secure_probe_conf() {
  printf 'security.protocol=SSL\nssl.ca.location=%s\nssl.certificate.location=%s\nssl.key.location=%s\n' \
    "$SEC/ca.pem" "$SEC/certs/admin.pem" "$SEC/certs/admin.key"
}

# Create (upsert) every role's SCRAM user through the mTLS listener as admin, then wait until the
# SASL_SSL listener accepts the admin's password. The snippet reads the password files itself.
secure_users() {
  local addr=$1 maddr=$2 py=""
  for py in "$REPO/.venv/bin/python" python3; do
    command -v "$py" >/dev/null 2>&1 && "$py" -c 'import confluent_kafka' 2>/dev/null && break
    py=""
  done
  [[ -n $py ]] || die "--secure needs Python with confluent_kafka (make venv) to create the SCRAM users"
  "$py" - "$SEC" "$addr" "$maddr" "${SECURE_ROLES[@]}" <<'EOF' || die "cannot create the SCRAM users (log: $SERVER_LOG)"
import sys, time
from confluent_kafka.admin import (AdminClient, ScramCredentialInfo, ScramMechanism,
                                   UserScramCredentialUpsertion)
sec, addr, maddr, roles = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
mtls = AdminClient({"bootstrap.servers": maddr, "security.protocol": "SSL", "log_level": 0,
                    "ssl.ca.location": f"{sec}/ca.pem", "ssl.certificate.location": f"{sec}/certs/admin.pem",
                    "ssl.key.location": f"{sec}/certs/admin.key"})
info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
ups = [UserScramCredentialUpsertion(r, info, open(f"{sec}/credentials/{r}.password", "rb").read().strip())
       for r in roles]
for fut in mtls.alter_user_scram_credentials(ups, request_timeout=30).values():
    fut.result()
pw = open(f"{sec}/credentials/admin.password").read().strip()
sasl = AdminClient({"bootstrap.servers": addr, "security.protocol": "SASL_SSL", "log_level": 0,
                    "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "admin", "sasl.password": pw,
                    "ssl.ca.location": f"{sec}/ca.pem", "reconnect.backoff.max.ms": 200})
deadline = time.time() + 30
while True:
    try:
        sasl.list_topics(timeout=1)
        break
    except Exception:
        if time.time() > deadline:
            sys.exit("SASL login as admin still fails 30s after creating the users")
        time.sleep(0.2)
EOF
}

secure_report() {
  local port=$1 mport=$2 mtls=$3 m=""
  (( mtls )) && m=1
  log "secure: SASL_SSL (SCRAM-SHA-512) on $HOST:$port, mTLS on $HOST:$mport; StandardAuthorizer, deny without ACL"
  log "secure: CA certificate      $SEC/ca.pem"
  log "secure: client configs      $SEC/clients/<role>.properties${m:+ and <role>-mtls.properties} (gpupipe --kafka-config-file)"
  log "secure: credentials         $SEC/credentials/<role>.password, certificates $SEC/certs/<role>.{pem,key}"
  log "secure: roles               ${SECURE_ROLES[*]} (admin is a super user; grant the rest with: gpupipe acls --apply --kafka-config-file $SEC/clients/admin.properties)"
}
