{{/* Names ------------------------------------------------------------------ */}}

{{- define "pdmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>", at most 63 characters. */}}
{{- define "pdmesh.component" -}}
{{- printf "%s-%s" (include "pdmesh.fullname" .root | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component -}}
{{- end -}}

{{- define "pdmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdmesh
{{ include "pdmesh.selectorLabels" . }}
{{- end -}}

{{- define "pdmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The NATS every process connects to: the external URL, or the chart's Service (tls:// with
nats.tls.secretName). Args: root, user ("" for none; the password comes from $(NATS_PASSWORD)). */}}
{{- define "pdmesh.natsUrl" -}}
{{- $v := .root.Values -}}
{{- if $v.nats.external.url -}}
{{- $v.nats.external.url -}}
{{- else -}}
{{- $auth := ternary (printf "%s:$(NATS_PASSWORD)@" .user) "" (ne .user "") -}}
{{- printf "%s://%s%s:%d" (ternary "tls" "nats" (ne $v.nats.tls.secretName "")) $auth (include "pdmesh.component" (dict "root" .root "component" "nats")) (int $v.nats.port) -}}
{{- end -}}
{{- end -}}

{{/* Does the chart's NATS have one user per role? */}}
{{- define "pdmesh.natsAuth" -}}
{{- if and (not .Values.nats.external.url) .Values.nats.auth.enabled -}}true{{- end -}}
{{- end -}}

{{/* The Secret with the NATS users' passwords (keys gateway, decode, prefill, planner). */}}
{{- define "pdmesh.natsAuthSecret" -}}
{{- default (include "pdmesh.component" (dict "root" . "component" "nats-auth")) .Values.nats.auth.existingSecret -}}
{{- end -}}

{{/* JetStream replicas of the registry bucket and prefill streams: mesh.jsReplicas, else 3 on the
chart's NATS cluster of 3 or more, else 1. */}}
{{- define "pdmesh.jsReplicas" -}}
{{- if not (kindIs "invalid" .Values.mesh.jsReplicas) -}}
{{- .Values.mesh.jsReplicas -}}
{{- else if and (not .Values.nats.external.url) (ge (int .Values.nats.replicas) 3) -}}
3
{{- else -}}
1
{{- end -}}
{{- end -}}

{{/* The served model as a subject token (what its prefill stream is named after). */}}
{{- define "pdmesh.modelToken" -}}
{{- regexReplaceAll "[^A-Za-z0-9_-]" (include "pdmesh.servedName" .) "_" -}}
{{- end -}}

{{/* Volumes every pdmesh pod needs to reach NATS: the CA (nats.tls.secretName), the creds files
(nats.external.credsSecret). */}}
{{- define "pdmesh.natsVolumes" -}}
{{- $n := .Values.nats -}}
{{- if $n.tls.secretName }}
- name: nats-ca
  secret:
    secretName: {{ $n.tls.secretName }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- if and $n.external.url $n.external.credsSecret }}
- name: nats-creds
  secret:
    secretName: {{ $n.external.credsSecret }}
{{- end }}
{{- end -}}

{{- define "pdmesh.natsMounts" -}}
{{- $n := .Values.nats -}}
{{- if $n.tls.secretName }}
- name: nats-ca
  mountPath: /etc/pdmesh/nats-ca
  readOnly: true
{{- end }}
{{- if and $n.external.url $n.external.credsSecret }}
- name: nats-creds
  mountPath: /etc/pdmesh/nats-creds
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pdmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The model directory inside the pods. */}}
{{- define "pdmesh.modelDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) -}}
{{- end -}}

{{/* Does this release serve a model from a volume (false for the mocker)? */}}
{{- define "pdmesh.usesModel" -}}
{{- if not .Values.workers.mock -}}true{{- end -}}
{{- end -}}

{{/* The name the pools serve under (what planner and clients see). */}}
{{- define "pdmesh.servedName" -}}
{{- if .Values.workers.mock -}}
mock
{{- else -}}
{{- default (base (trimSuffix "/" .Values.model.path)) .Values.model.servedName -}}
{{- end -}}
{{- end -}}

{{/* Environment of every pdmesh container. Args: root, component, natsUser (default: the component;
an embed worker joins NATS as a decode worker). */}}
{{- define "pdmesh.env" -}}
{{- $v := .root.Values -}}
{{- $user := .natsUser | default .component -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- if include "pdmesh.natsAuth" .root }}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdmesh.natsAuthSecret" .root }}
      key: {{ $user }}
- name: MESH_NATS_URL
  value: {{ include "pdmesh.natsUrl" (dict "root" .root "user" $user) | quote }}
{{- else }}
- name: MESH_NATS_URL
  value: {{ include "pdmesh.natsUrl" (dict "root" .root "user" "") | quote }}
{{- end }}
{{- if $v.nats.tls.secretName }}
- name: MESH_NATS_TLS_CA
  value: /etc/pdmesh/nats-ca/ca.crt
{{- end }}
{{- if and $v.nats.external.url $v.nats.external.credsSecret }}
- name: MESH_NATS_CREDS
  value: {{ printf "/etc/pdmesh/nats-creds/%s.creds" $user | quote }}
{{- end }}
- name: MESH_JS_REPLICAS
  value: {{ include "pdmesh.jsReplicas" .root | quote }}
- name: MESH_NATS_CONNECT_TIMEOUT
  value: {{ $v.mesh.natsConnectTimeout | quote }}
- name: MESH_NS
  value: {{ $v.mesh.namespace | quote }}
{{- if and $v.mesh.hashKey.existingSecret (ne .component "planner") }}
- name: MESH_HASH_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.mesh.hashKey.existingSecret }}
      key: {{ $v.mesh.hashKey.key }}
{{- end }}
- name: MESH_LOG_LEVEL
  value: {{ $v.mesh.logLevel | quote }}
{{- if and (include "pdmesh.usesModel" .root) (ne .component "planner") }}
- name: MESH_MODEL
  value: {{ include "pdmesh.modelDir" .root | quote }}
{{- end }}
- name: TOKENIZERS_PARALLELISM
  value: "false"
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" $v.otel.serviceNamePrefix .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),service.namespace=%s%s" $v.mesh.namespace (ternary (printf ",%s" $v.otel.resourceAttributes) "" (ne $v.otel.resourceAttributes "")) | quote }}
{{- if $v.otel.endpoint }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $v.otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $v.otel.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $v.otel.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $v.otel.samplerArg | quote }}
{{- else }}
- name: OTEL_TRACES_EXPORTER
  value: none
{{- end }}
- name: OTEL_METRICS_EXPORTER
  value: none
- name: OTEL_LOGS_EXPORTER
  value: none
{{- with $v.mesh.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The model volume (when a model is served). */}}
{{- define "pdmesh.modelVolume" -}}
{{- $m := .Values.model -}}
- name: model
{{- if eq $m.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else }}
  emptyDir:
    sizeLimit: 1Gi
{{- end }}
{{- end -}}

{{- define "pdmesh.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ ne .Values.model.source "tiny" }}
{{- end -}}

{{/* For model.source=tiny: an init container that writes the tiny model into the emptyDir. */}}
{{- define "pdmesh.tinyModelInit" -}}
{{- if and (include "pdmesh.usesModel" .) (eq .Values.model.source "tiny") }}
initContainers:
  - name: tiny-model
    image: {{ include "pdmesh.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["mesh"]
    args: ["model", "tiny", {{ include "pdmesh.modelDir" . | quote }}]
    securityContext:
      {{- include "pdmesh.containerSecurity" . | nindent 6 }}
    volumeMounts:
      {{- include "pdmesh.modelMount" . | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "pdmesh.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "pdmesh.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* nodeSelector, tolerations, affinity of a component's values (.). */}}
{{- define "pdmesh.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pdmesh.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* prometheus.io annotations of a pod. Args: root, port. */}}
{{- define "pdmesh.scrapeAnnotations" -}}
{{- if .root.Values.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}
