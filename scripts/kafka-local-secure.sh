# shellcheck shell=bash
# Sourced by scripts/kafka-local for `start --secure [--mtls]`: a throw-away CA, the broker's and
# every role's certificate (openssl), one SCRAM-SHA-512 user per gpupipe role plus admin, and the
# server.properties lines for a SASL_SSL listener (and an optional mTLS listener) behind the
# StandardAuthorizer with allow.everyone.if.no.acl.found=false.
#
# Layout under $STATE/secure (kept across restarts; `--fresh` makes new ones):
#   ca.pem                      the CA clients must trust (ssl.ca.location)
#   broker.pem                  broker key + certificate (CN=broker, SAN 127.0.0.1/localhost)
#   clients/<role>.properties   gpupipe --kafka-config-file for SASL_SSL (password by file)
#   clients/<role>-mtls.properties  the same role over mTLS (certificate, no password)
#   credentials/<role>.password the role's SCRAM password (mode 0600)
#   certs/<role>.pem, <role>.key    the role's client certificate (CN=<role>) for mTLS
#
# Principals: User:<role> on both listeners (SCRAM user name, or the certificate's CN through
# ssl.principal.mapping.rules). User:admin and User:broker (the broker itself, on the controller
# listener) are super users; everybody else needs ACLs (`gpupipe acls --apply`).

SECURE_ROLES=(producer metrics chargeback alerts report tail admin)

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
  local port=$1 mport=$2 role
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
    if [[ -n $mport ]]; then
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

# Extra arguments for `StorageTool format`: every SCRAM user goes into the first metadata records.
secure_format_args() {
  local role
  for role in "${SECURE_ROLES[@]}"; do
    printf -- '--add-scram\nSCRAM-SHA-512=[name=%s,password=%s]\n' "$role" "$(cat "$SEC/credentials/$role.password")"
  done
}

# server.properties lines replacing the PLAINTEXT listener block.
secure_server_config() {
  local port=$1 cport=$2 mport=$3 admin_pw listeners protomap
  admin_pw=$(cat "$SEC/credentials/admin.password")
  listeners="SASL_SSL://$HOST:$port,CONTROLLER://$HOST:$cport"
  protomap="CONTROLLER:SSL,SASL_SSL:SASL_SSL"
  if [[ -n $mport ]]; then
    listeners+=",MTLS://$HOST:$mport"
    protomap+=",MTLS:SSL"
  fi
  cat <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=$HOST:$cport
listeners=$listeners
advertised.listeners=$listeners
inter.broker.listener.name=SASL_SSL
controller.listener.names=CONTROLLER
listener.security.protocol.map=$protomap

# --secure: TLS everywhere; SCRAM-SHA-512 on SASL_SSL; certificates on CONTROLLER (the broker
# itself) and MTLS; principal = SCRAM user or certificate CN; deny unless an ACL allows.
ssl.keystore.type=PEM
ssl.keystore.location=$SEC/broker.pem
ssl.truststore.type=PEM
ssl.truststore.location=$SEC/ca.pem
ssl.endpoint.identification.algorithm=https
listener.name.controller.ssl.client.auth=required
listener.name.mtls.ssl.client.auth=required
ssl.principal.mapping.rules=RULE:^CN=([^,]+)\$/\$1/,DEFAULT
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$admin_pw";
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:broker
EOF
}

# Probe settings (env KAFKA_LOCAL_PROBE_CONF, newline-separated key=value): env, not argv.
secure_probe_conf() {
  printf 'security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\nsasl.username=admin\nsasl.password=%s\nssl.ca.location=%s\n' \
    "$(cat "$SEC/credentials/admin.password")" "$SEC/ca.pem"
}

secure_report() {
  local port=$1 mport=$2
  log "secure: SASL_SSL (SCRAM-SHA-512) on $HOST:$port${mport:+, mTLS on $HOST:$mport}; StandardAuthorizer, deny without ACL"
  log "secure: CA certificate      $SEC/ca.pem"
  log "secure: client configs      $SEC/clients/<role>.properties${mport:+ and <role>-mtls.properties} (gpupipe --kafka-config-file)"
  log "secure: credentials         $SEC/credentials/<role>.password, certificates $SEC/certs/<role>.{pem,key}"
  log "secure: roles               ${SECURE_ROLES[*]} (admin is a super user; grant the rest with: gpupipe acls --apply --kafka-config-file $SEC/clients/admin.properties)"
}
