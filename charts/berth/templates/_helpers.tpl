{{/*
The name of the chart, or nameOverride.
*/}}
{{- define "berth.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified name of the release's objects: fullnameOverride, else the
release name when it already contains the chart name, else
<release>-<chart>. Truncated to 63 characters (DNS label).
*/}}
{{- define "berth.fullname" -}}
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

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "berth.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: stable for the life of a release (never include the
version here: a Deployment's selector is immutable).
*/}}
{{- define "berth.selectorLabels" -}}
app.kubernetes.io/name: {{ include "berth.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The Kubernetes recommended labels, on every object of the chart.
*/}}
{{- define "berth.labels" -}}
helm.sh/chart: {{ include "berth.chart" . }}
{{ include "berth.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: controller
app.kubernetes.io/part-of: berth
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The ServiceAccount the controller runs as.
*/}}
{{- define "berth.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "berth.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The container image: repository@digest when a digest is set, else
repository:tag (tag defaults to the chart's appVersion).
*/}}
{{- define "berth.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The provider drivers to enable, comma-separated (the --providers flag).
*/}}
{{- define "berth.providers" -}}
{{- $enabled := list }}
{{- if .Values.providers.aws.enabled }}
{{- $enabled = append $enabled "aws" }}
{{- end }}
{{- if .Values.providers.fake.enabled }}
{{- $enabled = append $enabled "fake" }}
{{- end }}
{{- join "," $enabled }}
{{- end }}
