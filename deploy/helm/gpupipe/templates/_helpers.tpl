{{/* Names, labels and the pieces every gpupipe workload shares. */}}

{{- define "gpupipe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpupipe.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gpupipe.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{/* Name of one component's objects: <fullname>-<component>. Call with (list $ "metrics"). */}}
{{- define "gpupipe.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "gpupipe.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpupipe.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "gpupipe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpupipe
{{- end }}

{{/* Selector labels of one component. Call with (list $ "metrics"). */}}
{{- define "gpupipe.selectorLabels" -}}
{{- $root := index . 0 }}
app.kubernetes.io/name: {{ include "gpupipe.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "gpupipe.componentLabels" -}}
{{- $root := index . 0 }}
{{ include "gpupipe.labels" $root }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* The ConfigMap with prices.yaml and teams.yaml (chargeback and recommend mount it). */}}
{{- define "gpupipe.pricesConfigMap" -}}
{{- default (include "gpupipe.componentName" (list . "chargeback")) .Values.chargeback.existingConfigMap }}
{{- end }}

{{- define "gpupipe.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "gpupipe.serviceAccountName" -}}
{{- $root := index . 0 }}
{{- $sa := index . 2 }}
{{- if $sa.create }}
{{- default (include "gpupipe.componentName" (list $root (index . 1))) $sa.name }}
{{- else }}
{{- default "default" $sa.name }}
{{- end }}
{{- end }}

{{/*
Command-line flags from a map: string/number -> --NAME=VALUE, list -> one --NAME=ITEM each,
true -> --NAME, false/null -> nothing. Whole floats print as integers (YAML numbers are floats here).
*/}}
{{- define "gpupipe.flagValue" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{- define "gpupipe.flags" -}}
{{- range $name, $value := . }}
{{- if kindIs "bool" $value }}
{{- if $value }}
- {{ printf "--%s" $name | quote }}
{{- end }}
{{- else if kindIs "slice" $value }}
{{- range $value }}
- {{ printf "--%s=%s" $name (include "gpupipe.flagValue" .) | quote }}
{{- end }}
{{- else if not (kindIs "invalid" $value) }}
- {{ printf "--%s=%s" $name (include "gpupipe.flagValue" $value) | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Kafka and logging settings as GPUPIPE_* variables. Secret values come first as KAFKA_SECRET_<n>
and are referenced with $(VAR) from GPUPIPE_KAFKA_CONFIG, so they never appear on a command line.
*/}}
{{- define "gpupipe.kafkaEnv" -}}
{{- $k := .Values.kafka }}
{{- $settings := list }}
{{- range $key, $value := $k.config }}
{{- $settings = append $settings (printf "%s=%s" $key (include "gpupipe.flagValue" $value)) }}
{{- end }}
{{- if $k.tls.enabled }}
{{- $settings = append $settings (printf "ssl.ca.location=/etc/gpupipe/kafka-tls/%s" $k.tls.caFilename) }}
{{- if $k.tls.certFilename }}
{{- $settings = append $settings (printf "ssl.certificate.location=/etc/gpupipe/kafka-tls/%s" $k.tls.certFilename) }}
{{- end }}
{{- if $k.tls.keyFilename }}
{{- $settings = append $settings (printf "ssl.key.location=/etc/gpupipe/kafka-tls/%s" $k.tls.keyFilename) }}
{{- end }}
{{- end }}
{{- if $k.existingSecret }}
{{- $i := 0 }}
{{- range $setting, $secretKey := $k.secretKeys }}
- name: KAFKA_SECRET_{{ $i }}
  valueFrom:
    secretKeyRef:
      name: {{ $k.existingSecret }}
      key: {{ $secretKey }}
{{- $settings = append $settings (printf "%s=$(KAFKA_SECRET_%d)" $setting $i) }}
{{- $i = add1 $i }}
{{- end }}
{{- end }}
- name: GPUPIPE_BOOTSTRAP_SERVERS
  value: {{ required "kafka.bootstrapServers is required" $k.bootstrapServers | quote }}
{{- if $k.topicPrefix }}
- name: GPUPIPE_TOPIC_PREFIX
  value: {{ $k.topicPrefix | quote }}
{{- end }}
{{- if $k.schemaRegistryUrl }}
- name: GPUPIPE_SCHEMA_REGISTRY_URL
  value: {{ $k.schemaRegistryUrl | quote }}
{{- end }}
{{- if $settings }}
- name: GPUPIPE_KAFKA_CONFIG
  value: {{ join ";" $settings | quote }}
{{- end }}
- name: GPUPIPE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: GPUPIPE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- end }}

{{- define "gpupipe.kafkaVolumeMounts" -}}
{{- if .Values.kafka.tls.enabled }}
- name: kafka-tls
  mountPath: /etc/gpupipe/kafka-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "gpupipe.kafkaVolumes" -}}
{{- if .Values.kafka.tls.enabled }}
- name: kafka-tls
  secret:
    secretName: {{ required "kafka.tls.existingSecret is required with kafka.tls.enabled" .Values.kafka.tls.existingSecret }}
{{- end }}
{{- end }}

{{/*
Node identity in a service that acts on a record's hostname (alerts, metrics, chargeback, recommend):
with nodeIdentity.enabled, its flags and the CA ConfigMap's mount and volume, as YAML
{args, mounts, volumes} (empty lists when off), for `include ... | fromYaml`. One definition, so
no such service can be left taking any node's word.
*/}}
{{- define "gpupipe.nodeIdentity" -}}
{{- $args := list }}
{{- $mounts := list }}
{{- $vols := list }}
{{- with .Values.nodeIdentity }}{{ if .enabled }}
{{- $args = list (printf "--node-ca-file=/etc/gpupipe/node-ca/%s" .caKey) (printf "--node-identity=%s" .mode) (printf "--node-cert-names=%s" .certNames) }}
{{- $mounts = list (dict "name" "node-ca" "mountPath" "/etc/gpupipe/node-ca" "readOnly" true) }}
{{- $vols = list (dict "name" "node-ca" "configMap" (dict "name" .caConfigMap)) }}
{{- end }}{{ end }}
{{- toYaml (dict "args" $args "mounts" $mounts "volumes" $vols) }}
{{- end }}

{{/*
Liveness: the HTTP port answers (a broker outage must not restart every pod; the services wait
and recover by themselves). Readiness: /healthz, which reports the service's own health.
The node agent passes (list $c "/readyz" "/healthz"): readiness /readyz (503 also while it has
released NVML on request), liveness /healthz (its own loops and NVML only, never Kafka: a stalled
loop or a driver upgraded under it needs a restart).
*/}}
{{- define "gpupipe.probes" -}}
{{- $c := index . 0 }}
{{- $ready := "/healthz" }}
{{- $live := "" }}
{{- if gt (len .) 1 }}{{ $ready = index . 1 }}{{ end }}
{{- if gt (len .) 2 }}{{ $live = index . 2 }}{{ end }}
livenessProbe:
  {{- if $live }}
  httpGet:
    path: {{ $live }}
    port: metrics
  {{- else }}
  tcpSocket:
    port: metrics
  {{- end }}
  initialDelaySeconds: {{ $c.livenessProbe.initialDelaySeconds }}
  periodSeconds: {{ $c.livenessProbe.periodSeconds }}
readinessProbe:
  httpGet:
    path: {{ $ready }}
    port: metrics
  initialDelaySeconds: {{ $c.readinessProbe.initialDelaySeconds }}
  periodSeconds: {{ $c.readinessProbe.periodSeconds }}
{{- end }}

{{/*
The kernel-log relay of the producer pod: the only privileged container, gpupipe-kmsg-relay, which
serves the kernel log device on a unix socket in a memory emptyDir (the agent connects with no
capability). Every connection gets the log from its oldest record, so a restarted agent reads again
what it had not spooled; the agent's persisted cursor skips what it already handled. Same as
deploy/kubernetes/producer-daemonset.yaml.
*/}}
{{- define "gpupipe.kmsgRelay" -}}
{{- $root := index . 0 }}
{{- $c := index . 1 }}
- name: kmsg-relay
  image: {{ include "gpupipe.image" $root | quote }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command:
    - gpupipe-kmsg-relay
    - --device={{ $c.kmsg.path }}
    - --socket=/run/gpupipe/kmsg/kmsg.sock
  startupProbe:
    exec:
      command: ["test", "-S", "/run/gpupipe/kmsg/kmsg.sock"]
    periodSeconds: 1
  resources:
    {{- toYaml $c.kmsg.resources | nindent 4 }}
  securityContext:
    privileged: true
    runAsUser: 0
    readOnlyRootFilesystem: true
  volumeMounts:
    - name: kmsg-socket
      mountPath: /run/gpupipe/kmsg
{{- end }}
