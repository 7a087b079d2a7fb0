{{/* Names, labels, sizes and the shared pieces of the kvstore containers. */}}

{{- define "kvstore.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvstore.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "kvstore.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "kvstore.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "kvstore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstore.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvstore.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvstore.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvstore
{{- end }}

{{- define "kvstore.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* A component's service account: (dict "root" . "component" "metadata|agent|sidecar"). */}}
{{- define "kvstore.serviceAccountName" -}}
{{- printf "%s-%s" (default (include "kvstore.fullname" .root) .root.Values.serviceAccount.name) .component }}
{{- end }}

{{/* "true" where agents present projected service-account tokens bound to their node. */}}
{{- define "kvstore.projectedAgentTokens" -}}
{{- if and .Values.auth.enabled (eq .Values.auth.agentTokens "projected") }}true{{ end }}
{{- end }}

{{- define "kvstore.metadataAddress" -}}
{{- printf "%s-metadata.%s.svc:%d" (include "kvstore.fullname" .) .Release.Namespace (int .Values.metadata.port) }}
{{- end }}

{{/* "64Gi" -> 65536 (MiB); the schema allows only Mi, Gi and Ti. */}}
{{- define "kvstore.mebibytes" -}}
{{- $q := toString . }}
{{- if hasSuffix "Ti" $q }}{{ mul (trimSuffix "Ti" $q | int64) 1048576 }}
{{- else if hasSuffix "Gi" $q }}{{ mul (trimSuffix "Gi" $q | int64) 1024 }}
{{- else if hasSuffix "Mi" $q }}{{ trimSuffix "Mi" $q | int64 }}
{{- else }}{{ fail (printf "size %q: use Mi, Gi or Ti" $q) }}
{{- end }}
{{- end }}

{{/*
A Kubernetes memory quantity in bytes: a number, or digits (a decimal point allowed) with one
of k M G T P Ki Mi Gi Ti Pi or none (values.schema.json allows no other form).
*/}}
{{- define "kvstore.bytes" -}}
{{- if kindIs "string" . }}
{{- $number := regexFind "^([0-9]+(\\.[0-9]*)?|\\.[0-9]+)" . }}
{{- $factors := dict "" 1 "k" 1000 "Ki" 1024 "M" 1000000 "Mi" 1048576 "G" 1000000000 "Gi" 1073741824 "T" 1000000000000 "Ti" 1099511627776 "P" 1000000000000000 "Pi" 1125899906842624 }}
{{- $unit := trimPrefix $number . }}
{{- if or (not $number) (not (hasKey $factors $unit)) }}
{{- fail (printf "memory %q: use bytes or k, M, G, T, P, Ki, Mi, Gi, Ti, Pi" .) }}
{{- end }}
{{- mulf (float64 $number) (index $factors $unit) | int64 }}
{{- else }}
{{- int64 . }}
{{- end }}
{{- end }}

{{/*
The agent's memory limit holds its arena: the arena is shared memory, charged to the pod's
memory cgroup as it fills. (dict "conf" node-or-sidecar "section" "node|sidecar")
*/}}
{{- define "kvstore.checkAgentMemoryLimit" -}}
{{- $conf := .conf }}
{{- if hasKey ($conf.resources.limits | default dict) "memory" }}
{{- $shown := $conf.resources.limits.memory }}
{{- $limit := include "kvstore.bytes" $shown | int64 }}
{{- if not (kindIs "string" $shown) }}{{ $shown = $limit }}{{ end }}
{{- $needed := add (include "kvstore.mebibytes" $conf.hostCapacity) (include "kvstore.mebibytes" $conf.memoryOverhead) }}
{{- if lt $limit (mul $needed 1048576) }}
{{- fail (printf "%s.resources.limits.memory %v is below the host arena (%s.hostCapacity %s) plus the agent's own memory (%s.memoryOverhead %s): the arena is shared memory, counted against the limit, so the agent would be OOM-killed as it fills; set the limit to %dMi or more, or leave it out (it is then computed)" .section $shown .section $conf.hostCapacity .section $conf.memoryOverhead (int64 $needed)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
node.maxBlockBytes (0: one page) fits between a page and the arena, and in a private worker's
buffer: the agent refuses any other at start. (dict "conf" node-or-sidecar "root" .)
*/}}
{{- define "kvstore.checkMaxBlock" -}}
{{- $node := .root.Values.node }}
{{- $largest := $node.maxBlockBytes | int64 }}
{{- if $largest }}
{{- $arena := include "kvstore.bytes" .conf.hostCapacity | int64 }}
{{- $private := include "kvstore.bytes" $node.privateBufferBytes | int64 }}
{{- if or (lt $largest ($node.pageSizeBytes | int64)) (gt $largest $arena) (gt $largest $private) }}
{{- fail (printf "node.maxBlockBytes %d must be 0 (one page) or at least node.pageSizeBytes (%d), at most the arena (%s) and at most node.privateBufferBytes (%s), which a private worker's block passes through" $largest ($node.pageSizeBytes | int64) .conf.hostCapacity $node.privateBufferBytes) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Where agents run: node.nodeSelector, plus the GPU operator's label with gpuNodesOnly. */}}
{{- define "kvstore.nodeSelector" -}}
{{- $selector := deepCopy (.Values.node.nodeSelector | default dict) }}
{{- if .Values.node.gpuNodesOnly }}
{{- $selector = merge $selector (dict "nvidia.com/gpu.present" "true") }}
{{- end }}
{{- with $selector }}{{ toYaml (dict "nodeSelector" .) }}{{ end }}
{{- end }}

{{/* Pod-level security: non-root, the kvstore gid owns mounted secrets, default seccomp. */}}
{{- define "kvstore.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
runAsGroup: {{ .Values.runAsGroup }}
fsGroup: {{ .Values.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Container-level security; `rdma` adds IPC_LOCK (memory registration) to nothing else. */}}
{{- define "kvstore.securityContext" -}}
runAsNonRoot: true
runAsUser: {{ .root.Values.runAsUser }}
runAsGroup: {{ .root.Values.runAsGroup }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
  {{- if .rdma }}
  add: [IPC_LOCK]
  {{- end }}
{{- end }}

{{- define "kvstore.priorityClassName" -}}
{{- with .Values.priorityClass.name }}
priorityClassName: {{ . }}
{{- end }}
{{- end }}

{{/* A secret volume exposing only the listed keys, readable by the kvstore gid. */}}
{{- define "kvstore.secretVolume" -}}
- name: {{ .name }}
  secret:
    secretName: {{ .secret }}
    defaultMode: 0440
    items:
      {{- range .keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}

{{/*
The node agent container, for the DaemonSet (mode "node") and for sidecars (mode "sidecar").
Secrets are mounted files; the node id and the advertised address come from the downward API.
*/}}
{{- define "kvstore.agentContainer" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $sidecar := eq .mode "sidecar" }}
{{- $conf := ternary $v.sidecar $v.node $sidecar }}
{{- $rdma := and (not $sidecar) $v.node.rdma.enabled }}
{{- $memory := add (include "kvstore.mebibytes" $conf.hostCapacity) (include "kvstore.mebibytes" $conf.memoryOverhead) }}
{{- include "kvstore.checkAgentMemoryLimit" (dict "conf" $conf "section" .mode) }}
{{- include "kvstore.checkMaxBlock" (dict "conf" $conf "root" $root) }}
- name: kvstore-agent
  image: {{ include "kvstore.image" $root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if $sidecar }}
  restartPolicy: Always
  {{- end }}
  args:
    - node
    - --node-id
    - {{ ternary "$(POD_NAME)" "$(NODE_NAME)" $sidecar | quote }}
    - --socket-path
    - {{ ternary $v.sidecar.socketPath (printf "%s/agent.sock" "/run/kvstore") $sidecar }}
    - --host-capacity-bytes
    - {{ $conf.hostCapacity | quote }}
    - --page-size-bytes
    - {{ $v.node.pageSizeBytes | int64 | quote }}
    {{- if $v.node.maxBlockBytes }}
    - --max-block-bytes
    - {{ $v.node.maxBlockBytes | int64 | quote }}
    {{- end }}
    - --host-policy
    - {{ $v.node.hostPolicy }}
    {{- if and (not $sidecar) $v.node.disk.enabled }}
    - --disk-dir
    - /var/lib/kvstore/disk
    - --disk-capacity-bytes
    - {{ $v.node.disk.capacity | quote }}
    - --disk-policy
    - {{ $v.node.diskPolicy }}
    {{- end }}
    {{- if $v.metadata.enabled }}
    - --metadata-address
    - {{ include "kvstore.metadataAddress" $root }}
    {{- end }}
    {{- if include "kvstore.projectedAgentTokens" $root }}
    - --metadata-token-file
    - /etc/kvstore/agent-token/token
    {{- else if $v.auth.enabled }}
    - --metadata-token-file
    - /etc/kvstore/auth/{{ $v.auth.agentTokenKey }}
    {{- end }}
    {{- if $v.clusterSecret.existingSecret }}
    - --cluster-secret-file
    - /etc/kvstore/cluster/{{ $v.clusterSecret.key }}
    {{- else if ne $v.node.transfer "none" }}
    {{- if and (not $sidecar) $v.node.hostNetwork }}
    {{- fail "node.hostNetwork puts the agents' transfer port on the host, where every process (and no NetworkPolicy) reaches it: set clusterSecret.existingSecret" }}
    {{- end }}
    - --insecure-transfer
    {{- end }}
    {{- if $v.node.workerCredentials.existingSecret }}
    {{- if and (ne $v.node.transfer "none") (not $v.clusterSecret.existingSecret) }}
    {{- fail "node.workerCredentials keeps tenants apart only with clusterSecret.existingSecret set: without it the transfer port serves any tenant's blocks" }}
    {{- end }}
    - --worker-credentials
    - /etc/kvstore/workers/{{ $v.node.workerCredentials.key }}
    {{- end }}
    - --transfer
    - {{ $v.node.transfer }}
    {{- if ne $v.node.transfer "none" }}
    - --transfer-host
    - 0.0.0.0
    - --transfer-port
    - {{ $v.node.transferPort | int64 | quote }}
    - --advertise-host
    - $(POD_IP)
    {{- end }}
    - --node-metrics-listen
    - 0.0.0.0:{{ $v.node.metricsPort }}
    - --max-workers
    - {{ $v.node.maxWorkers | int64 | quote }}
    - --private-buffer-bytes
    - {{ $v.node.privateBufferBytes | quote }}
  env:
    - name: NODE_NAME
      valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    - name: HOME
      value: /tmp
    {{- if $v.tls.enabled }}
    - name: KVSTORE_NODE_METADATA_TLS_CA
      value: /etc/kvstore/tls/{{ $v.tls.caKey }}
    {{- end }}
    {{- if $rdma }}
    - name: RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY
      value: "true"
    - name: UCX_WARN_UNUSED_ENV_VARS
      value: "n"
    {{- range $name, $value := $v.node.rdma.env }}
    - name: {{ $name }}
      value: {{ $value | quote }}
    {{- end }}
    {{- end }}
  ports:
    {{- if ne $v.node.transfer "none" }}
    - name: transfer
      containerPort: {{ $v.node.transferPort }}
      protocol: TCP
    {{- end }}
    - name: agent-metrics
      containerPort: {{ $v.node.metricsPort }}
      protocol: TCP
  {{- if $sidecar }}
  startupProbe:
    httpGet: {path: /metrics, port: agent-metrics}
    periodSeconds: 1
    failureThreshold: 120
  {{- end }}
  readinessProbe:
    httpGet: {path: /metrics, port: agent-metrics}
    periodSeconds: 10
  livenessProbe:
    httpGet: {path: /metrics, port: agent-metrics}
    initialDelaySeconds: 10
    periodSeconds: 20
    failureThreshold: 3
  resources:
    requests:
      {{- toYaml $conf.resources.requests | nindent 6 }}
      {{- if not (hasKey $conf.resources.requests "memory") }}
      memory: {{ printf "%dMi" (int64 $memory) }}
      {{- end }}
      {{- if $rdma }}
      {{- with $v.node.rdma.resources }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      {{- end }}
    limits:
      {{- toYaml $conf.resources.limits | nindent 6 }}
      {{- if not (hasKey $conf.resources.limits "memory") }}
      memory: {{ printf "%dMi" (int64 $memory) }}
      {{- end }}
      {{- if $rdma }}
      {{- with $v.node.rdma.resources }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      {{- end }}
  securityContext:
    {{- include "kvstore.securityContext" (dict "root" $root "rdma" $rdma) | nindent 4 }}
  volumeMounts:
    - {name: shm, mountPath: /dev/shm}
    - {name: tmp, mountPath: /tmp}
    - {name: socket-dir, mountPath: /run/kvstore}
    {{- if and (not $sidecar) $v.node.disk.enabled }}
    - {name: disk, mountPath: /var/lib/kvstore/disk}
    {{- end }}
    {{- if include "kvstore.projectedAgentTokens" $root }}
    - {name: agent-token, mountPath: /etc/kvstore/agent-token, readOnly: true}
    {{- else if $v.auth.enabled }}
    - {name: auth, mountPath: /etc/kvstore/auth, readOnly: true}
    {{- end }}
    {{- if $v.tls.enabled }}
    - {name: tls, mountPath: /etc/kvstore/tls, readOnly: true}
    {{- end }}
    {{- if $v.clusterSecret.existingSecret }}
    - {name: cluster-secret, mountPath: /etc/kvstore/cluster, readOnly: true}
    {{- end }}
    {{- if $v.node.workerCredentials.existingSecret }}
    - {name: worker-credentials, mountPath: /etc/kvstore/workers, readOnly: true}
    {{- end }}
{{- end }}

{{/* The agent's volumes, except socket-dir and disk (DaemonSet: hostPath; sidecar: emptyDir). */}}
{{- define "kvstore.agentVolumes" -}}
{{- $v := .root.Values }}
{{- $conf := ternary $v.sidecar $v.node (eq .mode "sidecar") }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ printf "%dMi" (int64 (add (include "kvstore.mebibytes" $conf.hostCapacity) (include "kvstore.mebibytes" $conf.shmHeadroom))) }}
- name: tmp
  emptyDir: {sizeLimit: 1Gi}
{{- if include "kvstore.projectedAgentTokens" .root }}
# The pod's own token for the metadata service: bound to this pod (and so to its node), replaced
# by the kubelet before it expires; the agent reads the file again as it changes.
- name: agent-token
  projected:
    defaultMode: 0440
    sources:
      - serviceAccountToken:
          audience: kvstore
          expirationSeconds: {{ $v.auth.agentTokenExpirationSeconds | int64 }}
          path: token
{{- else if $v.auth.enabled }}
{{ include "kvstore.secretVolume" (dict "name" "auth" "secret" $v.auth.existingSecret "keys" (list $v.auth.agentTokenKey)) }}
{{- end }}
{{- if $v.tls.enabled }}
{{ include "kvstore.secretVolume" (dict "name" "tls" "secret" $v.tls.existingSecret "keys" (list $v.tls.caKey)) }}
{{- end }}
{{- if $v.clusterSecret.existingSecret }}
{{ include "kvstore.secretVolume" (dict "name" "cluster-secret" "secret" $v.clusterSecret.existingSecret "keys" (list $v.clusterSecret.key)) }}
{{- end }}
{{- if $v.node.workerCredentials.existingSecret }}
{{ include "kvstore.secretVolume" (dict "name" "worker-credentials" "secret" $v.node.workerCredentials.existingSecret "keys" (list $v.node.workerCredentials.key)) }}
{{- end }}
{{- end }}
