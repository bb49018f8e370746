{{/*
Graceful drain on pod deletion (rolling update, scale-down, eviction). The kubelet runs the
preStop sleep first, so the pod leaves Service endpoints and the routers' view before it stops
taking work; then SIGTERM starts the process's drain: NOT_SERVING, new work refused (the router
re-routes it), running requests finish for up to drainTimeoutSeconds, what is left is cut (the
router migrates decode streams). terminationGracePeriodSeconds covers all of it plus a margin
for the process to release its KV and exit, so the kubelet never SIGKILLs a drain.
Each takes one component's values (.Values.router, .Values.prefill, .Values.decode).
*/}}
{{- define "pdmesh.shutdownMarginSeconds" -}}15{{- end }}

{{- define "pdmesh.terminationGracePeriodSeconds" -}}
{{- add (int .preStopSleepSeconds) (int .drainTimeoutSeconds) (int (include "pdmesh.shutdownMarginSeconds" .)) }}
{{- end }}

{{- define "pdmesh.drainEnv" -}}
- name: PDMESH_DRAIN_TIMEOUT_S
  value: {{ .drainTimeoutSeconds | quote }}
{{- end }}

{{- define "pdmesh.preStop" -}}
{{- if gt (int .preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ int .preStopSleepSeconds }}
{{- end }}
{{- end }}
