{{/*
One engine pool (prefill or decode) as a Deployment; takes
(dict "root" $ "component" "prefill" "values" .Values.prefill). Both roles share this shape:
they differ only in the sub-command, the decode role flag and whether the KV port is open.
Each pod advertises its own IP (PDMESH_ADVERTISE_HOST from the downward API) in the Redis
registry, which is how the router finds it; a restarted pod re-registers with a new id.
*/}}
{{- define "pdmesh.engineDeployment" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $isPrefill := eq .component "prefill" }}
{{- $gpu := int (include "pdmesh.engineGpus" .) }}
{{- $ports := dict (printf "%s.port" .component) $v.port (printf "%s.metricsPort" .component) $v.metricsPort (printf "%s.kvPort" .component) $v.kvPort }}
{{- include "pdmesh.distinctPorts" $ports }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdmesh.componentName" . }}
  labels:
    {{- include "pdmesh.labels" . | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdmesh.selectorLabels" . | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  template:
    metadata:
      labels:
        {{- include "pdmesh.selectorLabels" . | nindent 8 }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "pdmesh.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $root.Values.tls.enabled }}
      # Publishes <pod>.<headless Service>.<namespace>.svc, the name the engine advertises.
      subdomain: {{ include "pdmesh.componentName" . }}
      {{- end }}
      {{- $range := $root.Values.networkPolicy.kvDataPorts }}
      {{- range $name, $port := $ports }}
      {{- if and (ge (int $port) (int $range.port)) (le (int $port) (int $range.endPort)) }}
      {{- fail (printf "pdmesh: %s (%d) lies in networkPolicy.kvDataPorts (%d-%d), the engines' ephemeral KV data port range" $name (int $port) (int $range.port) (int $range.endPort)) }}
      {{- end }}
      {{- end }}
      {{- if gt (int $range.port) (int $range.endPort) }}
      {{- fail "pdmesh: networkPolicy.kvDataPorts.port must not exceed endPort" }}
      {{- end }}
      {{- /* The tcp KV data plane binds an ephemeral port: keep it in the range the
      NetworkPolicies open between engines (networkPolicy.kvDataPorts). */}}
      {{- $podSecurity := deepCopy $root.Values.podSecurityContext }}
      {{- $sysctl := dict "name" "net.ipv4.ip_local_port_range" "value" (printf "%d %d" (int $range.port) (int $range.endPort)) }}
      {{- $_ := set $podSecurity "sysctls" (append ($podSecurity.sysctls | default list) $sysctl) }}
      securityContext:
        {{- toYaml $podSecurity | nindent 8 }}
      terminationGracePeriodSeconds: {{ include "pdmesh.terminationGracePeriodSeconds" $v }}
      {{- with (include "pdmesh.modelInitContainer" .) }}
      initContainers:
        {{- . | trim | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "pdmesh.image" . }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["pdmesh", {{ .component | quote }}]
          env:
            {{- include "pdmesh.podEnv" $root | nindent 12 }}
            {{- include "pdmesh.commonEnv" $root | nindent 12 }}
            - name: PDMESH_MODEL
              value: {{ include "pdmesh.modelRef" $root | quote }}
            - name: PDMESH_SERVED_MODEL_NAME
              value: {{ $root.Values.model.name | quote }}
            - name: PDMESH_HOST
              value: {{ $root.Values.bindHost | quote }}
            - name: PDMESH_PORT
              value: {{ $v.port | quote }}
            - name: PDMESH_ADVERTISE_HOST
              value: {{ include "pdmesh.advertiseHost" . | quote }}
            {{- include "pdmesh.redisUrlEnv" $root | nindent 12 }}
            {{- include "pdmesh.securityEnv" (dict "root" $root "gateway" false) | nindent 12 }}
            - name: PDMESH_HEARTBEAT_TTL_S
              value: {{ $root.Values.engine.heartbeatTtlSeconds | quote }}
            - name: PDMESH_KV_PORT
              value: {{ $v.kvPort | quote }}
            {{- if not $isPrefill }}
            - name: PDMESH_ROLE
              value: {{ $v.role | quote }}
            {{- end }}
            {{- include "pdmesh.engineSettingsEnv" . | nindent 12 }}
            {{- include "pdmesh.metricsEnv" (dict "root" $root "port" $v.metricsPort) | nindent 12 }}
            {{- include "pdmesh.drainEnv" $v | nindent 12 }}
            {{- include "pdmesh.otelEnv" (dict "root" $root "service" .component) | trim | nindent 12 }}
            {{- with $v.env }}
            {{- include "pdmesh.extraEnv" . | trim | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            - name: kv
              containerPort: {{ $v.kvPort }}
              protocol: TCP
            {{- with (include "pdmesh.metricsContainerPort" $v.metricsPort) }}
            {{- . | trim | nindent 12 }}
            {{- end }}
          {{- include "pdmesh.serverProbes" (dict "root" $root "port" $v.port) | trim | nindent 10 }}
          {{- with (include "pdmesh.preStop" $v) }}
          {{- . | trim | nindent 10 }}
          {{- end }}
          volumeMounts:
            {{- include "pdmesh.modelMounts" $root | nindent 12 }}
            {{- include "pdmesh.securityMounts" (dict "root" $root "gateway" false) | nindent 12 }}
            # A CPU engine's KV cache file and the shm segments; the root filesystem is read-only.
            - name: dshm
              mountPath: /dev/shm
          resources:
            {{- $resources := deepCopy ($v.resources | default dict) }}
            {{- if gt $gpu 0 }}
            {{- $limits := merge (dict "nvidia.com/gpu" $gpu) ($resources.limits | default dict) }}
            {{- $_ := set $resources "limits" $limits }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
      volumes:
        {{- include "pdmesh.modelVolume" $root | trim | nindent 8 }}
        {{- include "pdmesh.securityVolumes" $root | nindent 8 }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.shmSizeLimit }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $tolerations := $v.tolerations | default list }}
      {{- if gt $gpu 0 }}
      {{- $tolerations = append $tolerations (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
      {{- end }}
      {{- with $tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/*
The engine's settings as env vars, one per key of engine.settings merged with the pool's
`engine:` overrides: a camelCase key becomes PDMESH_<SNAKE_CASE> (kvCacheMemory ->
PDMESH_KV_CACHE_MEMORY), the env var of the engine flag of that name (pdmesh/config.py). Null
values are left out (the engine's default); a pool with GPUs runs on cuda. Takes the same dict
as pdmesh.engineDeployment.
*/}}
{{- define "pdmesh.engineSettingsEnv" -}}
{{- $settings := merge (deepCopy (.values.engine | default dict)) (deepCopy .root.Values.engine.settings) }}
{{- if gt (int (include "pdmesh.engineGpus" .)) 0 }}
{{- $_ := set $settings "device" "cuda" }}
{{- end }}
{{- range $key := keys $settings | sortAlpha }}
{{- $value := get $settings $key }}
{{- if not (kindIs "invalid" $value) }}
- name: PDMESH_{{ $key | snakecase | upper }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The GPUs of one pod of a pool (its nvidia.com/gpu limit; 0 = a CPU pool). An engine with
tensor parallelism runs one rank per GPU, so `gpu: auto` asks for the pool's
tensorParallelSize of them, and an explicit count below it fails here rather than in a pod
that cannot start. Takes the same dict as pdmesh.engineDeployment.
*/}}
{{- define "pdmesh.engineGpus" -}}
{{- $v := .values }}
{{- /* the pool's value, else the shared one, as pdmesh.engineSettingsEnv merges them */}}
{{- $tp := int (coalesce (get ($v.engine | default dict) "tensorParallelSize") .root.Values.engine.settings.tensorParallelSize 1) }}
{{- if eq (toString $v.gpu) "auto" }}
{{- $tp }}
{{- else }}
{{- $gpu := int $v.gpu }}
{{- if and (gt $gpu 0) (lt $gpu $tp) }}
{{- fail (printf "pdmesh: %s.gpu (%d) is less than its tensorParallelSize (%d): an engine runs one rank per GPU; set %s.gpu to %d or auto (= tensorParallelSize), or 0 for a CPU pool" .component $gpu $tp .component $tp) }}
{{- end }}
{{- $gpu }}
{{- end }}
{{- end }}
