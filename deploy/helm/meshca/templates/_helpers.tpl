{{/*
Labels of every object of the CA: the kustomize base's two, and Helm's.
*/}}
{{- define "meshca.labels" -}}
app.kubernetes.io/name: meshca
app.kubernetes.io/part-of: meshca
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/*
Labels of the node agent's objects (deploy/kustomize/agent-node).
*/}}
{{- define "meshca.agentLabels" -}}
app.kubernetes.io/name: meshca-agent
app.kubernetes.io/part-of: meshca
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/*
The CA's image.
*/}}
{{- define "meshca.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
The node agent's image (the CA's unless set).
*/}}
{{- define "meshca.agentImage" -}}
{{- $repository := .Values.nodeAgent.image.repository | default .Values.image.repository -}}
{{- $tag := .Values.nodeAgent.image.tag | default .Values.image.tag | default .Chart.AppVersion -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{/*
The signer name, checked: DOMAIN/PATH.
*/}}
{{- define "meshca.signerName" -}}
{{- $name := .Values.podCertificates.signerName | required "podCertificates.signerName is required (the RBAC names it)" -}}
{{- if not (regexMatch "^[^/]+/.+$" $name) -}}
{{- fail (printf "podCertificates.signerName %q is not a DOMAIN/PATH signer name" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/*
The trusted node agents (NS/SA), comma-separated, or empty.
*/}}
{{- define "meshca.trustedNodeAgents" -}}
{{- $agents := list -}}
{{- if or .Values.trustedNodeAgents.meshcaAgent .Values.nodeAgent.enabled -}}
{{- $agents = append $agents (printf "%s/meshca-agent" .Release.Namespace) -}}
{{- end -}}
{{- range .Values.trustedNodeAgents.extra -}}
{{- if not (regexMatch "^[^/]+/[^/]+$" .) -}}
{{- fail (printf "trustedNodeAgents.extra: %q is not NAMESPACE/SERVICEACCOUNT" .) -}}
{{- end -}}
{{- $agents = append $agents . -}}
{{- end -}}
{{- $agents | uniq | join "," -}}
{{- end -}}
