//! A small tree over quick-xml's events: enough to read EC2's answers
//! (every one a document of elements and text, no attributes that matter)
//! by element name.

use quick_xml::escape::resolve_predefined_entity;
use quick_xml::events::Event;

/// An element: its local name (the namespace prefix dropped), its text
/// (entities resolved, surrounding whitespace trimmed) and its children in
/// document order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Element {
    pub name: String,
    pub text: String,
    pub children: Vec<Element>,
}

impl Element {
    /// Parses a whole document and returns its root element.
    pub fn parse(doc: &str) -> Result<Element, String> {
        let mut reader = quick_xml::Reader::from_str(doc);
        // The element a Start opened, innermost last; a sentinel holds the
        // root.
        let mut open: Vec<Element> = vec![Element::default()];
        loop {
            let event = reader
                .read_event()
                .map_err(|e| format!("at byte {}: {e}", reader.error_position()))?;
            match event {
                Event::Start(e) => open.push(Element::named(e.local_name().as_ref())),
                Event::Empty(e) => {
                    let el = Element::named(e.local_name().as_ref());
                    innermost(&mut open).children.push(el);
                }
                Event::End(_) => {
                    let mut done = open.pop().ok_or("unbalanced end tag")?;
                    done.text = done.text.trim().to_string();
                    innermost(&mut open).children.push(done);
                }
                Event::Text(t) => {
                    let text = t.xml10_content().map_err(|e| e.to_string())?;
                    innermost(&mut open).text.push_str(&text);
                }
                Event::CData(t) => {
                    let text = t.decode().map_err(|e| e.to_string())?;
                    innermost(&mut open).text.push_str(&text);
                }
                Event::GeneralRef(r) => {
                    let resolved = match r.resolve_char_ref().map_err(|e| e.to_string())? {
                        Some(c) => c.to_string(),
                        None => {
                            let name = r.decode().map_err(|e| e.to_string())?;
                            resolve_predefined_entity(&name)
                                .ok_or_else(|| format!("unknown entity &{name};"))?
                                .to_string()
                        }
                    };
                    innermost(&mut open).text.push_str(&resolved);
                }
                Event::Eof => break,
                Event::Comment(_) | Event::Decl(_) | Event::PI(_) | Event::DocType(_) => {}
            }
        }
        let mut sentinel = match open.as_slice() {
            [_] => open.pop().unwrap_or_default(),
            _ => return Err("unclosed element at the end of the document".into()),
        };
        match sentinel.children.len() {
            1 => Ok(sentinel.children.remove(0)),
            0 => Err("no element in the document".into()),
            n => Err(format!("{n} root elements")),
        }
    }

    fn named(name: &[u8]) -> Element {
        Element {
            name: String::from_utf8_lossy(name).into_owned(),
            ..Default::default()
        }
    }

    /// The first child called `name`.
    pub fn child(&self, name: &str) -> Option<&Element> {
        self.children.iter().find(|c| c.name == name)
    }

    /// Every child called `name`.
    pub fn children<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Element> + 'a {
        self.children.iter().filter(move |c| c.name == name)
    }

    /// The element at a path of child names (`["placement",
    /// "availabilityZone"]`).
    pub fn at(&self, path: &[&str]) -> Option<&Element> {
        path.iter().try_fold(self, |el, name| el.child(name))
    }

    /// The text at a path of child names, when the element is there and
    /// its text is not empty.
    pub fn text_at(&self, path: &[&str]) -> Option<String> {
        self.at(path)
            .map(|el| el.text.clone())
            .filter(|t| !t.is_empty())
    }

    /// The `item`s of the set child called `set` (EC2's lists:
    /// `<instancesSet><item>…</item>…</instancesSet>`); none when the set is
    /// absent or empty.
    pub fn items<'a>(&'a self, set: &'a str) -> impl Iterator<Item = &'a Element> + 'a {
        self.child(set).into_iter().flat_map(|s| s.children("item"))
    }

    /// Every element called `name` in this element's subtree (itself
    /// included), depth first.
    pub fn descendants<'a>(&'a self, name: &'a str) -> Vec<&'a Element> {
        let mut out = Vec::new();
        let mut stack = vec![self];
        while let Some(el) = stack.pop() {
            if el.name == name {
                out.push(el);
            }
            stack.extend(el.children.iter().rev());
        }
        out
    }
}

fn innermost(open: &mut [Element]) -> &mut Element {
    // The sentinel is never popped while parsing: an End without its Start
    // is refused by the reader (`check_end_names`, on by default).
    open.last_mut().expect("the sentinel")
}

/// `text` escaped for an XML text node.
pub fn escape(text: &str) -> String {
    quick_xml::escape::escape(text).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_an_ec2_answer_by_name_with_entities_resolved() {
        let doc = r#"<?xml version="1.0" encoding="UTF-8"?>
<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15">
  <reservationSet><item><instancesSet>
    <item><instanceId>i-1</instanceId><tagSet><item><key>a&amp;b</key><value>&#x41;&lt;</value></item></tagSet>
      <placement><availabilityZone>eu-west-1a</availabilityZone></placement><reason/></item>
    <item><instanceId>i-2</instanceId><tagSet/></item>
  </instancesSet></item></reservationSet>
  <nextToken><![CDATA[tok]]></nextToken>
</DescribeInstancesResponse>"#;
        let root = Element::parse(doc).expect("parses");
        assert_eq!(root.name, "DescribeInstancesResponse");
        let instances: Vec<_> = root
            .items("reservationSet")
            .flat_map(|r| r.items("instancesSet"))
            .collect();
        assert_eq!(instances.len(), 2);
        assert_eq!(
            instances[0].text_at(&["instanceId"]).as_deref(),
            Some("i-1")
        );
        assert_eq!(
            instances[0]
                .text_at(&["placement", "availabilityZone"])
                .as_deref(),
            Some("eu-west-1a")
        );
        assert_eq!(instances[0].text_at(&["reason"]), None);
        let tag = instances[0].items("tagSet").next().expect("a tag");
        assert_eq!(tag.text_at(&["key"]).as_deref(), Some("a&b"));
        assert_eq!(tag.text_at(&["value"]).as_deref(), Some("A<"));
        assert_eq!(instances[1].items("tagSet").count(), 0);
        assert_eq!(root.text_at(&["nextToken"]).as_deref(), Some("tok"));
        assert_eq!(root.descendants("instanceId").len(), 2);
    }

    #[test]
    fn refuses_what_is_not_one_well_formed_document() {
        for bad in [
            "",
            "<html><body>502 Bad Gateway</body>",
            "<a></b>",
            "<a/><b/>",
            "<a>&nbsp;</a>",
        ] {
            assert!(Element::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(escape("a<b&c"), "a&lt;b&amp;c");
    }
}
