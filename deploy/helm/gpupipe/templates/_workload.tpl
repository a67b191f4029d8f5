{{/*
The pod template of a consumer service (metrics, chargeback, alerts): one container running
`gpupipe <command>` with the Kafka environment, its flags, probes and volumes.
Call with (list $ "component" $values "command" extraArgsList extraEnvList extraMountsList extraVolumesList saName).
*/}}
{{- define "gpupipe.consumerPod" -}}
{{- $root := index . 0 }}
{{- $comp := index . 1 }}
{{- $c := index . 2 }}
{{- $cmd := index . 3 }}
{{- $args := index . 4 }}
{{- $env := index . 5 }}
{{- $mounts := index . 6 }}
{{- $vols := index . 7 }}
{{- $sa := index . 8 }}
{{- /* a 10th item, false: the pod has its ServiceAccount but mounts no token (nothing calls the API) */}}
{{- $token := true }}
{{- if gt (len .) 9 }}{{ $token = index . 9 }}{{ end }}
metadata:
  labels:
    {{- include "gpupipe.selectorLabels" (list $root $comp) | trim | nindent 4 }}
    {{- with $c.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $c.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if $sa }}
  serviceAccountName: {{ $sa }}
  {{- if not $token }}
  automountServiceAccountToken: false
  {{- end }}
  {{- else }}
  automountServiceAccountToken: false
  {{- end }}
  {{- with $c.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $c.affinity }}
  affinity:
    {{- toYaml $c.affinity | nindent 4 }}
  {{- else if gt (int $c.replicaCount) 1 }}
  # Replicas on different nodes when possible (a pair on one node is not a pair).
  affinity:
    podAntiAffinity:
      preferredDuringSchedulingIgnoredDuringExecution:
        - weight: 100
          podAffinityTerm:
            topologyKey: kubernetes.io/hostname
            labelSelector:
              matchLabels:
                {{- include "gpupipe.selectorLabels" (list $root $comp) | trim | nindent 16 }}
  {{- end }}
  {{- with $c.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ $comp }}
      image: {{ include "gpupipe.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      args:
        - {{ $cmd }}
        {{- with $args }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with include "gpupipe.flags" $c.flags | trim }}{{ . | nindent 8 }}{{ end }}
        {{- with $c.arguments }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      env:
        {{- include "gpupipe.kafkaEnv" $root | trim | nindent 8 }}
        {{- with $env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $c.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: metrics
          containerPort: {{ or $c.port $c.service.port }}
          protocol: TCP
      {{- include "gpupipe.probes" (list $c) | trim | nindent 6 }}
      resources:
        {{- toYaml $c.resources | nindent 8 }}
      {{- with $c.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $allMounts := concat (default list $mounts) (default list $c.extraVolumeMounts) }}
      {{- $kafkaMounts := include "gpupipe.kafkaVolumeMounts" $root | trim }}
      {{- if or $allMounts $kafkaMounts }}
      volumeMounts:
        {{- with $allMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $kafkaMounts | trim }}{{ . | nindent 8 }}{{ end }}
      {{- end }}
  {{- $allVols := concat (default list $vols) (default list $c.extraVolumes) }}
  {{- $kafkaVols := include "gpupipe.kafkaVolumes" $root | trim }}
  {{- if or $allVols $kafkaVols }}
  volumes:
    {{- with $allVols }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $kafkaVols | trim }}{{ . | nindent 4 }}{{ end }}
  {{- end }}
{{- end }}
