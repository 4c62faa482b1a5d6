{{/* Names and labels shared by every template. */}}
{{- define "duplex.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "duplex.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "duplex.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "duplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "duplex.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret and key that hold DUPLEX_REDIS_URL. */}}
{{- define "duplex.redisSecretName" -}}
{{- default (printf "%s-redis" (include "duplex.fullname" .)) .Values.redis.existingSecret -}}
{{- end -}}

{{- define "duplex.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "duplex.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{- define "duplex.apiKeysEnabled" -}}
{{- if or .Values.apiKeys.keys .Values.apiKeys.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* Environment every duplex container gets: settings, the Redis URL, optional API keys. */}}
{{- define "duplex.env" -}}
- name: DUPLEX_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "duplex.redisSecretName" . }}
      key: redisUrl
{{- end -}}

{{/* The worker image: the one entry of image.workers whose plugins name workers.plugin. */}}
{{- define "duplex.workerImage" -}}
{{- $plugin := .Values.workers.plugin -}}
{{- $holders := list -}}
{{- $offered := list -}}
{{- range $kind, $image := .Values.image.workers -}}
{{- if $image -}}
{{- if has $plugin $image.plugins -}}
{{- $holders = append $holders $kind -}}
{{- end -}}
{{- $offered = append $offered (printf "%s (%s)" $kind (join ", " $image.plugins)) -}}
{{- end -}}
{{- end -}}
{{- if not $holders -}}
{{- fail (printf "workers.plugin %q: no worker image holds it. image.workers offers %s; build an image with the plugin (docker/worker.Dockerfile) and list it under that image's plugins" $plugin (join "; " $offered)) -}}
{{- end -}}
{{- if gt (len $holders) 1 -}}
{{- fail (printf "workers.plugin %q is listed by several images (image.workers: %s): list it under one" $plugin (join ", " $holders)) -}}
{{- end -}}
{{- $image := index .Values.image.workers (first $holders) -}}
{{- printf "%s:%s" $image.repository ($image.tag | default .Chart.AppVersion) -}}
{{- end -}}
