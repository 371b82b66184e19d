{{/*
Names and labels. The label app.kubernetes.io/name is always "radixserve" (radixserve.contracts.constants.LABEL_NAME_VALUE):
the operator's children carry it too, and the monitors select engines, routers and the operator by it.
*/}}

{{- define "radixserve.name" -}}
radixserve
{{- end }}

{{/* Object name prefix: the release name, or "<release>-radixserve" when the release name lacks "radixserve".
Dots (allowed in release names) become "-": the metrics Service name must be a DNS-1035 label. */}}
{{- define "radixserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains "radixserve" .Release.Name }}
{{- .Release.Name | replace "." "-" | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-radixserve" (.Release.Name | replace "." "-") | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "radixserve.operatorName" -}}
{{- printf "%s-operator" (include "radixserve.fullname" .) }}
{{- end }}

{{- define "radixserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object the chart creates. */}}
{{- define "radixserve.labels" -}}
helm.sh/chart: {{ include "radixserve.chart" . }}
{{ include "radixserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: radixserve
{{- end }}

{{- define "radixserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radixserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The operator's labels and pod selector (component operator, beside the engines and routers). */}}
{{- define "radixserve.operatorLabels" -}}
{{ include "radixserve.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "radixserve.operatorSelectorLabels" -}}
{{ include "radixserve.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "radixserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "radixserve.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image the operator runs and hands to engines and routers: REPOSITORY:TAG (tag default appVersion). */}}
{{- define "radixserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The operator's RBAC rules (files/operator-rbac.yaml): a dict with lists "namespaced" and "cluster". */}}
{{- define "radixserve.rbacRules" -}}
{{- .Files.Get "files/operator-rbac.yaml" }}
{{- end }}

{{/* Namespaces the monitors look in: the watched ones plus the release's (the operator), or all. */}}
{{- define "radixserve.monitorNamespaceSelector" -}}
{{- if .Values.operator.watchNamespaces }}
matchNames:
{{- range (uniq (append .Values.operator.watchNamespaces .Release.Namespace)) }}
  - {{ . | quote }}
{{- end }}
{{- else }}
any: true
{{- end }}
{{- end }}
