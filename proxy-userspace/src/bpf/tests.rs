use super::load::*;

/// BTF with `u8` (1), `struct Ok { u32 }` (2), an enum's union whose tag sits at byte 4
/// (3), and a plain union whose members all start at 0 (4).
fn enum_btf() -> Vec<u8> {
    let ty = |name: u32, kind: u32, vlen: u32, size: u32| {
        [name.to_le_bytes(), ((kind << 24) | vlen).to_le_bytes(), size.to_le_bytes()].concat()
    };
    let member = |name: u32, ty: u32, bits: u32| [name, ty, bits].map(u32::to_le_bytes).concat();
    let types = [
        ty(1, 1, 0, 1),
        8u32.to_le_bytes().to_vec(),
        ty(4, 4, 1, 4),
        member(7, 1, 0),
        ty(0, 5, 2, 8),
        member(0, 1, 32),
        member(4, 2, 0),
        ty(0, 5, 2, 4),
        member(7, 1, 0),
        member(4, 2, 0),
    ]
    .concat();
    let strings = b"\0u8\0Ok\0v\0".to_vec();
    let header = [
        vec![0x9f, 0xeb, 1, 0],
        24u32.to_le_bytes().to_vec(),
        0u32.to_le_bytes().to_vec(),
        (types.len() as u32).to_le_bytes().to_vec(),
        (types.len() as u32).to_le_bytes().to_vec(),
        (strings.len() as u32).to_le_bytes().to_vec(),
    ]
    .concat();
    [header, types, strings].concat()
}

#[test]
fn a_union_with_a_member_past_offset_0_becomes_a_struct_in_offset_order() {
    let mut btf = enum_btf();
    let before = btf.clone();
    assert_eq!(btf_unions_as_structs(&mut btf), 1);
    let word = |btf: &[u8], at: usize| u32::from_le_bytes(btf[at..at + 4].try_into().unwrap());
    // Type 3 starts after the header (24), type 1 (16) and type 2 (24).
    let at = 24 + 16 + 24;
    assert_eq!(word(&btf, at + 4) >> 24, 4, "now a STRUCT");
    assert_eq!(word(&btf, at + 4) & 0xffff, 2);
    assert_eq!([word(&btf, at + 16), word(&btf, at + 20)], [2, 0], "Ok at bit 0 first");
    assert_eq!([word(&btf, at + 28), word(&btf, at + 32)], [1, 32], "then the tag at bit 32");
    // The union whose members all start at 0 stays as it was, and so does everything else.
    assert_eq!(btf[..at], before[..at]);
    assert_eq!(btf[at + 36..], before[at + 36..]);
}

#[test]
fn btf_of_an_unknown_kind_is_left_alone() {
    let mut btf = enum_btf();
    // Type 1's kind becomes 31, which BTF does not define.
    btf[24 + 7] = 31;
    let before = btf.clone();
    assert_eq!(btf_unions_as_structs(&mut btf), 0);
    assert_eq!(btf, before);
}
