{{/*
Secure-by-default wiring shared by every pdmesh pod (docs/SECURITY.md): the cluster token file,
the TLS certificate files, the Redis credentials, and the volumes that carry them. Secrets are
mounted read-only as files (group-readable for fsGroup), never put on a command line.
*/}}

{{- define "pdmesh.tokenSecretName" -}}
{{- .Values.clusterToken.existingSecret | default (include "pdmesh.componentName" (dict "root" . "component" "cluster-token")) }}
{{- end }}

{{- define "pdmesh.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (include "pdmesh.componentName" (dict "root" . "component" "redis-auth")) }}
{{- end }}

{{- define "pdmesh.tlsSecretName" -}}
{{- if .Values.tls.certManager.enabled }}
{{- include "pdmesh.componentName" (dict "root" . "component" "tls") }}
{{- else }}
{{- required "pdmesh: tls.enabled needs tls.existingSecret (tls.crt, tls.key, ca.crt) or tls.certManager.enabled" .Values.tls.existingSecret }}
{{- end }}
{{- end }}

{{/* A Secret value generated once: the live object's value on upgrades, else a fresh one. */}}
{{- define "pdmesh.stableRandom" -}}
{{- $live := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $live $live.data (hasKey $live.data .key) }}
{{- index $live.data .key }}
{{- else }}
{{- randAlphaNum 32 | b64enc }}
{{- end }}
{{- end }}

{{/* Whether the built-in Redis or a configured external one takes a password. */}}
{{- define "pdmesh.redisPasswordRef" -}}
{{- if and .Values.redis.enabled .Values.redis.auth.enabled }}
{{- dict "name" (include "pdmesh.redisSecretName" .) "key" .Values.redis.auth.existingSecretKey | toJson }}
{{- else if and (not .Values.redis.enabled) .Values.redis.external.passwordSecret.name }}
{{- .Values.redis.external.passwordSecret | toJson }}
{{- end }}
{{- end }}

{{/*
Env of a pdmesh container; takes (dict "root" $ "gateway" bool). The router and the engines get
the token file, the TLS files and the Redis credentials; the gateway (which only calls the
router's public Generate API, on localhost) gets the TLS client files and its HTTPS flags.
*/}}
{{- define "pdmesh.securityEnv" -}}
{{- $root := .root }}
{{- $tls := $root.Values.tls }}
{{- if $tls.enabled }}
- name: PDMESH_TLS_CERT
  value: {{ printf "%s/tls.crt" $tls.mountPath | quote }}
- name: PDMESH_TLS_KEY
  value: {{ printf "%s/tls.key" $tls.mountPath | quote }}
- name: PDMESH_TLS_CA
  value: {{ printf "%s/ca.crt" $tls.mountPath | quote }}
{{- if and .gateway $tls.gatewayHttps }}
- name: PDMESH_SSL_CERTFILE
  value: {{ printf "%s/tls.crt" $tls.mountPath | quote }}
- name: PDMESH_SSL_KEYFILE
  value: {{ printf "%s/tls.key" $tls.mountPath | quote }}
{{- end }}
{{- end }}
{{- if not .gateway }}
{{- if $root.Values.clusterToken.enabled }}
- name: PDMESH_CLUSTER_TOKEN_FILE
  value: /etc/pdmesh/cluster-token/token
{{- end }}
{{- with (include "pdmesh.redisPasswordRef" $root) }}
{{- $ref := fromJson . }}
- name: PDMESH_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $ref.name }}
      key: {{ $ref.key }}
{{- end }}
{{- if and (not $root.Values.redis.enabled) $root.Values.redis.external.username }}
- name: PDMESH_REDIS_USERNAME
  value: {{ $root.Values.redis.external.username | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Mounts matching pdmesh.securityEnv; takes (dict "root" $ "gateway" bool). */}}
{{- define "pdmesh.securityMounts" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  mountPath: {{ .root.Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- if and (not .gateway) .root.Values.clusterToken.enabled }}
- name: cluster-token
  mountPath: /etc/pdmesh/cluster-token
  readOnly: true
{{- end }}
{{- end }}

{{- define "pdmesh.securityVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "pdmesh.tlsSecretName" . }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- if .Values.clusterToken.enabled }}
- name: cluster-token
  secret:
    secretName: {{ include "pdmesh.tokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.clusterToken.existingSecretKey }}
        path: token
{{- end }}
{{- end }}

{{/*
What an engine advertises in the registry. With TLS the router and the decode engines verify
the name on the engine's certificate, so the engine advertises its pod DNS name
(<pod>.<headless Service>.<namespace>.svc, published because the pod's `subdomain` is that
Service), which a wildcard certificate covers; without TLS, its pod IP. Takes the engine ctx.
*/}}
{{- define "pdmesh.advertiseHost" -}}
{{- if .root.Values.tls.enabled }}
{{- printf "$(POD_NAME).%s.%s.svc" (include "pdmesh.componentName" .) .root.Release.Namespace }}
{{- else }}
{{- print "$(POD_IP)" }}
{{- end }}
{{- end }}

{{/*
Probes of a gRPC server; takes (dict "root" $ "port" n). The kubelet's native gRPC probe
speaks plaintext only, so under TLS it would fail the handshake: then the probes check that
the port accepts connections (tcpSocket), and readiness gating relies on the registry
(a draining engine leaves it) rather than the health service.
*/}}
{{- define "pdmesh.serverProbes" -}}
{{- if .root.Values.tls.enabled }}
{{- $p := .root.Values.probes }}
startupProbe:
  tcpSocket:
    port: {{ .port }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
livenessProbe:
  tcpSocket:
    port: {{ .port }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
readinessProbe:
  tcpSocket:
    port: {{ .port }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
{{- else }}
{{- include "pdmesh.grpcProbes" . }}
{{- end }}
{{- end }}

{{/* One component's NetworkPolicy; takes (dict "root" $ "component" c "ingress" l "egress" l). */}}
{{- define "pdmesh.networkPolicy" -}}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "pdmesh.componentName" . }}
  labels:
    {{- include "pdmesh.labels" . | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "pdmesh.selectorLabels" . | nindent 6 }}
  policyTypes:
    - Ingress
    - Egress
  ingress:
    {{- toYaml .ingress | nindent 4 }}
  egress:
    {{- if .egress }}
    {{- toYaml .egress | nindent 4 }}
    {{- else }} []
    {{- end }}
{{- end }}
