{{/*
Names, labels and the pieces every pdmesh pod shares: image, model volume and init step, Redis
URL, OpenTelemetry variables, probes. Component templates stay short by calling these.
*/}}

{{- define "pdmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdmesh.fullname" -}}
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

{{/* Name of one component's objects: <fullname>-<component>, within 63 characters. */}}
{{- define "pdmesh.componentName" -}}
{{- printf "%s-%s" (include "pdmesh.fullname" .root | trunc 52 | trimSuffix "-") .component }}
{{- end }}

{{- define "pdmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component; takes (dict "root" $ "component" "router"). */}}
{{- define "pdmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdmesh.labels" -}}
helm.sh/chart: {{ include "pdmesh.chart" .root }}
{{ include "pdmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdmesh
{{- end }}

{{- define "pdmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdmesh.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The pdmesh image; a component's own `image` fields override the global ones. */}}
{{- define "pdmesh.image" -}}
{{- $own := .values.image | default dict }}
{{- $repo := $own.repository | default .root.Values.image.repository }}
{{- $tag := $own.tag | default .root.Values.image.tag | default .root.Chart.AppVersion }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* ---- Redis ---------------------------------------------------------------------------- */}}

{{- define "pdmesh.redisHost" -}}
{{- printf "%s.%s.svc" (include "pdmesh.componentName" (dict "root" . "component" "redis")) .Release.Namespace }}
{{- end }}

{{/* Env entry PDMESH_REDIS_URL: the built-in Redis, an external URL, or a Secret key. */}}
{{- define "pdmesh.redisUrlEnv" -}}
- name: PDMESH_REDIS_URL
{{- if .Values.redis.enabled }}
  value: {{ printf "redis://%s:%d/0" (include "pdmesh.redisHost" .) (int .Values.redis.port) | quote }}
{{- else if .Values.redis.external.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else if .Values.redis.external.url }}
  value: {{ .Values.redis.external.url | quote }}
{{- else }}
{{- fail "pdmesh: the router discovers engines through Redis: set redis.enabled=true, or redis.external.url / redis.external.existingSecret" }}
{{- end }}
{{- end }}

{{/* ---- Model ---------------------------------------------------------------------------- */}}

{{/* What engines pass as --model: the alias (found converted in the cache) or the directory. */}}
{{- define "pdmesh.modelRef" -}}
{{- if eq .Values.model.source "volume" }}
{{- required "pdmesh: model.source=volume needs model.path (the model directory inside model.mountPath)" .Values.model.path }}
{{- else }}
{{- .Values.model.alias }}
{{- end }}
{{- end }}

{{- define "pdmesh.modelVolume" -}}
{{- $v := .Values.model.volume }}
{{- if and (eq .Values.model.source "volume") (eq $v.type "emptyDir") }}
{{- fail "pdmesh: model.source=volume needs a volume that holds the model: set model.volume.type to existingClaim, hostPath or persistentVolumeClaim" }}
{{- end }}
- name: model
{{- if eq $v.type "existingClaim" }}
  persistentVolumeClaim:
    claimName: {{ required "pdmesh: model.volume.existingClaim is required for type existingClaim" $v.existingClaim }}
{{- else if eq $v.type "hostPath" }}
  hostPath:
    path: {{ required "pdmesh: model.volume.hostPath is required for type hostPath" $v.hostPath }}
    type: Directory
{{- else if eq $v.type "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ include "pdmesh.componentName" (dict "root" . "component" "model") }}
{{- else }}
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "pdmesh.modelMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Env every pdmesh container gets: converted-model cache and writable caches under /tmp. */}}
{{- define "pdmesh.commonEnv" -}}
- name: PDMESH_CACHE_DIR
  value: {{ .Values.model.mountPath | quote }}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: HF_HUB_OFFLINE
  value: "1"
- name: PDMESH_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{- end }}

{{/* The init step (model.source=init): convert the alias once into the model volume. */}}
{{- define "pdmesh.modelInitContainer" -}}
{{- if eq .root.Values.model.source "init" }}
- name: model
  image: {{ include "pdmesh.image" . }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["pdmesh", "model", "path", {{ .root.Values.model.alias | quote }}]
  env:
    {{- include "pdmesh.commonEnv" .root | nindent 4 }}
  volumeMounts:
    {{- include "pdmesh.modelMounts" .root | nindent 4 }}
  resources:
    {{- toYaml .root.Values.model.initResources | nindent 4 }}
  securityContext:
    {{- toYaml .root.Values.containerSecurityContext | nindent 4 }}
{{- end }}
{{- end }}

{{/* ---- OpenTelemetry --------------------------------------------------------------------- */}}

{{/* Standard OTEL_* variables of one container; takes (dict "root" $ "service" "router"). */}}
{{- define "pdmesh.otelEnv" -}}
{{- $o := .root.Values.otel }}
{{- if $o.enabled }}
- name: OTEL_SDK_DISABLED
  value: "false"
- name: OTEL_SERVICE_NAME
  value: {{ printf "pdmesh-%s" .service | quote }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_METRICS_EXPORTER
  value: none
- name: OTEL_LOGS_EXPORTER
  value: none
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $o.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $o.protocol | quote }}
- name: OTEL_PROPAGATORS
  value: tracecontext,baggage
- name: OTEL_TRACES_SAMPLER
  value: {{ $o.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $o.samplerArg | quote }}
{{- if $o.headersSecret.name }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ $o.headersSecret.name }}
      key: {{ $o.headersSecret.key }}
{{- end }}
{{- $attrs := list (printf "service.namespace=%s" .root.Release.Name) "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" "service.instance.id=$(POD_NAME)" }}
{{- if $o.resourceAttributes }}
{{- $attrs = append $attrs $o.resourceAttributes }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- else }}
- name: OTEL_SDK_DISABLED
  value: "true"
- name: OTEL_TRACES_EXPORTER
  value: none
{{- end }}
{{- end }}

{{/* Pod identity from the downward API; first in env so later values can say $(POD_IP). */}}
{{- define "pdmesh.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}

{{/* A map of extra variables as env entries, in name order. */}}
{{- define "pdmesh.extraEnv" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* ---- Metrics ----------------------------------------------------------------------------- */}}

{{/*
PDMESH_METRICS_* of one process; takes (dict "root" $ "port" <metricsPort>). The bind address is
bindHost, never the service's default of its gRPC --host, so a scrape from another pod reaches it
whatever PDMESH_HOST says. -1 passes through: the process then serves no /metrics.
*/}}
{{- define "pdmesh.metricsEnv" -}}
- name: PDMESH_METRICS_HOST
  value: {{ .root.Values.bindHost | quote }}
- name: PDMESH_METRICS_PORT
  value: {{ .port | quote }}
{{- end }}

{{/* The `metrics` containerPort for a metricsPort; nothing for -1. */}}
{{- define "pdmesh.metricsContainerPort" -}}
{{- if ge (int .) 1 }}
- name: metrics
  containerPort: {{ . }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* The `metrics` Service port (what the ServiceMonitor scrapes); nothing for -1. */}}
{{- define "pdmesh.metricsServicePort" -}}
{{- if ge (int .) 1 }}
- name: metrics
  port: {{ . }}
  targetPort: metrics
  protocol: TCP
  appProtocol: http
{{- end }}
{{- end }}

{{/*
Fails when two ports of one pod are the same (the second server would exit at start-up with
"address in use"); takes a dict of value name -> port, -1 meaning "not opened".
*/}}
{{- define "pdmesh.distinctPorts" -}}
{{- $seen := dict }}
{{- range $name, $port := . }}
{{- if ge (int $port) 1 }}
{{- $key := toString (int $port) }}
{{- if hasKey $seen $key }}
{{- fail (printf "pdmesh: %s and %s are both %s; the ports of one pod must differ" (get $seen $key) $name $key) }}
{{- end }}
{{- $_ := set $seen $key $name }}
{{- end }}
{{- end }}
{{- end }}

{{/* ---- Probes ------------------------------------------------------------------------------ */}}

{{/* Native gRPC probes (grpc.health.v1) on `port`; takes (dict "root" $ "port" 50051). */}}
{{- define "pdmesh.grpcProbes" -}}
{{- $p := .root.Values.probes }}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
{{- end }}
