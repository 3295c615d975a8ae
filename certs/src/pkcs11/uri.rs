//! RFC 7512 PKCS#11 URIs: which module, token and object a key is.
//!
//! `pkcs11:token=meshca;object=root?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/etc/meshca/pin`
//!
//! Path attributes (`;`-separated) name the token and the object; query
//! attributes (`&`-separated) name the module and where the PIN is read
//! from. Values are percent-decoded. The PIN itself is never accepted in
//! the URI (`pin-value`): it would end up in process listings, shell
//! histories and logs; it is read from the file `pin-source` names.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Why a PKCS#11 URI was refused. The message names the URI (which never
/// holds a PIN: `pin-value` is refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{uri}: not a usable PKCS#11 URI (RFC 7512): {reason}")]
pub struct UriError {
    /// The URI as given (cut to 512 characters).
    pub uri: String,
    /// What is wrong.
    pub reason: String,
}

/// A parsed PKCS#11 URI naming one key.
#[derive(Clone, PartialEq, Eq)]
pub struct Pkcs11Uri {
    text: String,
    /// `token`: the token's label.
    pub token: Option<String>,
    /// `serial`: the token's serial number.
    pub serial: Option<String>,
    /// `manufacturer`: the token's manufacturer.
    pub manufacturer: Option<String>,
    /// `model`: the token's model.
    pub model: Option<String>,
    /// `slot-id`: the slot's number.
    pub slot_id: Option<u64>,
    /// `object`: the key's label (`CKA_LABEL`).
    pub object: Option<String>,
    /// `id`: the key's `CKA_ID`, bytes.
    pub id: Option<Vec<u8>>,
    /// `module-path`: the PKCS#11 module (shared library) to load.
    pub module_path: PathBuf,
    /// `pin-source`: the file the user PIN is read from, if any.
    pub pin_source: Option<PathBuf>,
}

impl Pkcs11Uri {
    /// The URI as given. It holds no PIN, so it may be logged.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The same token and module with `object` set to `label` (for keys
    /// made next to this one).
    pub fn with_object(&self, label: &str) -> Self {
        let mut other = self.clone();
        other.object = Some(label.to_string());
        other.id = None;
        other
    }

    /// How the object is named, for messages: `object "root"`, `id 01ab`.
    pub fn describe_object(&self) -> String {
        match (&self.object, &self.id) {
            (Some(label), Some(id)) => format!("object {label:?} id {}", crate::profile::hex(id)),
            (Some(label), None) => format!("object {label:?}"),
            (None, Some(id)) => format!("id {}", crate::profile::hex(id)),
            (None, None) => "any private key".to_string(),
        }
    }
}

impl fmt::Display for Pkcs11Uri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for Pkcs11Uri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pkcs11Uri({:?})", self.text)
    }
}

/// Longest URI accepted.
const MAX_URI_LEN: usize = 4096;

fn percent_decode(value: &str) -> Result<Vec<u8>, String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent-encoding in {value:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn decode_text(name: &str, value: &str) -> Result<String, String> {
    String::from_utf8(percent_decode(value)?).map_err(|_| format!("{name} is not UTF-8"))
}

/// The URI as error messages show it: at most 512 characters, and
/// nothing from a `pin-value` attribute on (however it is spelt or
/// wherever it stands: an error found before the parser reaches it must
/// not show the PIN either).
fn shown_in_messages(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let pin_at = ["pin-value", "pin%2dvalue"]
        .iter()
        .filter_map(|name| lower.find(name))
        .min();
    let visible = match pin_at {
        // `find` on the ASCII-lowercased copy: the same byte offsets, at
        // a character boundary.
        Some(at) => format!("{}pin-value=<hidden>", &text[..at]),
        None => text.to_string(),
    };
    visible.chars().take(512).collect()
}

impl FromStr for Pkcs11Uri {
    type Err = UriError;

    fn from_str(text: &str) -> Result<Self, UriError> {
        let shown = shown_in_messages(text);
        let err = |reason: String| UriError {
            uri: shown.clone(),
            reason,
        };
        if text.len() > MAX_URI_LEN {
            return Err(err(format!("longer than {MAX_URI_LEN} bytes")));
        }
        let rest = text
            .strip_prefix("pkcs11:")
            .ok_or_else(|| err("it must start with \"pkcs11:\"".into()))?;
        let (path, query) = match rest.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (rest, None),
        };
        let mut uri = Pkcs11Uri {
            text: String::new(),
            token: None,
            serial: None,
            manufacturer: None,
            model: None,
            slot_id: None,
            object: None,
            id: None,
            module_path: PathBuf::new(),
            pin_source: None,
        };
        let mut module_path = None;
        for attr in path.split(';').filter(|a| !a.is_empty()) {
            let (name, value) = attr
                .split_once('=')
                .ok_or_else(|| err(format!("path attribute {attr:?} has no '='")))?;
            let once = |taken: bool| -> Result<(), UriError> {
                match taken {
                    true => Err(err(format!("{name} is given twice"))),
                    false => Ok(()),
                }
            };
            match name {
                "token" => {
                    once(uri.token.is_some())?;
                    uri.token = Some(decode_text(name, value).map_err(err)?);
                }
                "serial" => {
                    once(uri.serial.is_some())?;
                    uri.serial = Some(decode_text(name, value).map_err(err)?);
                }
                "manufacturer" => {
                    once(uri.manufacturer.is_some())?;
                    uri.manufacturer = Some(decode_text(name, value).map_err(err)?);
                }
                "model" => {
                    once(uri.model.is_some())?;
                    uri.model = Some(decode_text(name, value).map_err(err)?);
                }
                "object" => {
                    once(uri.object.is_some())?;
                    uri.object = Some(decode_text(name, value).map_err(err)?);
                }
                "id" => {
                    once(uri.id.is_some())?;
                    uri.id = Some(percent_decode(value).map_err(err)?);
                }
                "slot-id" => {
                    once(uri.slot_id.is_some())?;
                    let id = decode_text(name, value)
                        .map_err(err)?
                        .parse::<u64>()
                        .map_err(|_| err(format!("slot-id {value:?} is not a number")))?;
                    uri.slot_id = Some(id);
                }
                "type" => {
                    let kind = decode_text(name, value).map_err(err)?;
                    if kind != "private" {
                        return Err(err(format!(
                            "type={kind} names no signing key: use type=private or leave it out"
                        )));
                    }
                }
                // Library attributes say which module implementation is
                // meant; module-path names it exactly, so they are not
                // needed to find anything.
                "library-manufacturer"
                | "library-description"
                | "library-version"
                | "slot-manufacturer"
                | "slot-description" => {}
                other if other.starts_with("x-") => {}
                other => return Err(err(format!("unknown path attribute {other:?}"))),
            }
        }
        for attr in query.into_iter().flat_map(|q| q.split('&')) {
            if attr.is_empty() {
                continue;
            }
            let (name, value) = attr
                .split_once('=')
                .ok_or_else(|| err(format!("query attribute {attr:?} has no '='")))?;
            match name {
                "module-path" => {
                    if module_path.is_some() {
                        return Err(err("module-path is given twice".into()));
                    }
                    module_path = Some(PathBuf::from(decode_text(name, value).map_err(err)?));
                }
                "pin-source" => {
                    if uri.pin_source.is_some() {
                        return Err(err("pin-source is given twice".into()));
                    }
                    let source = decode_text(name, value).map_err(err)?;
                    let path = source.strip_prefix("file:").unwrap_or(&source);
                    // file:///etc/pin and file:/etc/pin both name /etc/pin.
                    let path = path.strip_prefix("//").unwrap_or(path);
                    if path.is_empty() {
                        return Err(err("pin-source names no file".into()));
                    }
                    uri.pin_source = Some(PathBuf::from(path));
                }
                "pin-value" => {
                    // The URI, with the PIN in it, would be shown in
                    // messages: refuse without repeating it.
                    return Err(UriError {
                        uri: shown.clone(),
                        reason: "the PIN is never taken from the URI: put it in a file \
                                 readable only by meshca and name it with pin-source=file:PATH"
                            .into(),
                    });
                }
                "module-name" => {
                    return Err(err(
                        "module-name is not supported: name the module's file with module-path"
                            .into(),
                    ))
                }
                other if other.starts_with("x-") => {}
                other => return Err(err(format!("unknown query attribute {other:?}"))),
            }
        }
        uri.module_path = module_path.ok_or_else(|| {
            err("module-path is missing: name the PKCS#11 module, e.g. \
                 module-path=/usr/lib/softhsm/libsofthsm2.so"
                .into())
        })?;
        if uri.object.is_none() && uri.id.is_none() {
            return Err(err(
                "no key named: give object=LABEL (or id=...) of the private key".into(),
            ));
        }
        uri.text = text.to_string();
        Ok(uri)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_uri_is_read_attribute_by_attribute() {
        let uri: Pkcs11Uri = "pkcs11:token=mesh%20ca;object=root;id=%01%ab;slot-id=7;type=private\
             ?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/run/pin"
            .parse()
            .unwrap();
        assert_eq!(uri.token.as_deref(), Some("mesh ca"));
        assert_eq!(uri.object.as_deref(), Some("root"));
        assert_eq!(uri.id.as_deref(), Some(&[0x01, 0xab][..]));
        assert_eq!(uri.slot_id, Some(7));
        assert_eq!(
            uri.module_path,
            PathBuf::from("/usr/lib/softhsm/libsofthsm2.so")
        );
        assert_eq!(uri.pin_source, Some(PathBuf::from("/run/pin")));
        assert_eq!(uri.describe_object(), "object \"root\" id 01ab");
    }

    #[test]
    fn file_uris_and_bare_paths_name_the_pin_file() {
        for source in ["file:///run/pin", "file:/run/pin", "/run/pin"] {
            let uri: Pkcs11Uri = format!("pkcs11:object=k?module-path=/m.so&pin-source={source}")
                .parse()
                .unwrap();
            assert_eq!(uri.pin_source, Some(PathBuf::from("/run/pin")), "{source}");
        }
    }

    #[test]
    fn a_pin_in_the_uri_is_refused_without_being_repeated() {
        let e = "pkcs11:token=t;object=k?module-path=/m.so&pin-value=123456"
            .parse::<Pkcs11Uri>()
            .unwrap_err();
        let message = e.to_string();
        assert!(!message.contains("123456"), "{message}");
        assert!(message.contains("pin-source"), "{message}");
        assert!(message.contains("pkcs11:token=t;object=k"), "{message}");
    }

    #[test]
    fn bad_uris_are_refused_naming_the_uri_and_the_problem() {
        for (text, problem) in [
            ("token=t;object=k", "must start with"),
            ("pkcs11:token=t;object=k", "module-path is missing"),
            ("pkcs11:token=t?module-path=/m.so", "no key named"),
            (
                "pkcs11:token=t;object=k;colour=red?module-path=/m.so",
                "colour",
            ),
            ("pkcs11:object=%zz?module-path=/m.so", "percent"),
            ("pkcs11:object=a;object=b?module-path=/m.so", "twice"),
            ("pkcs11:object=a;type=cert?module-path=/m.so", "type=cert"),
            ("pkcs11:object=a;slot-id=x?module-path=/m.so", "slot-id"),
        ] {
            let e = text.parse::<Pkcs11Uri>().unwrap_err();
            let message = e.to_string();
            assert!(message.contains(problem), "{text}: {message}");
            assert!(
                message.starts_with(&text[..text.len().min(20)]),
                "{message}"
            );
        }
    }

    #[test]
    fn a_pin_value_never_shows_in_any_error_even_one_found_before_it() {
        for text in [
            "pkcs11:object=k;slot-id=x?module-path=/m.so&pin-value=1234",
            "pkcs11:object=k;bad%zz?pin-value=1234",
            "pkcs11:object=k?module-path=/a&module-path=/b&pin-value=1234",
            "pkcs11:object=k?PIN-VALUE=1234&module-path=/m.so",
            "pkcs11:object=k?pin%2Dvalue=1234",
            "nope:object=k?pin-value=1234",
        ] {
            let e = text.parse::<Pkcs11Uri>().unwrap_err();
            let shown = e.to_string();
            assert!(!shown.contains("1234"), "{text}: {shown}");
        }
    }
}
